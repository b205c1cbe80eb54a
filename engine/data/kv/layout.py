"""The KV layout: what one page of KV cache holds and how its bytes are laid out.

A page holds the keys and values of `page_size` consecutive tokens for every layer.
Its tensor shape is `(2, num_layers, page_size, num_kv_heads, head_dim)`: K/V first,
then layers, then tokens. One page is therefore one contiguous block of
`page_nbytes` bytes, so it moves between tiers and processes in one piece. This is
SGLang's `page_first_direct` host layout `(2, pages, L, page, H, D)` seen one page at
a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.data.kv.errors import KVConfigError, KVLayoutError

if TYPE_CHECKING:
    import torch

# Names a layout may carry (torch's dtype names), with their item sizes. Names (not torch objects)
# are what get written into disk headers and shared segments, so they must stay stable; a layout
# names its dtype without importing torch, which a process that only passes refs along never loads.
_ITEMSIZES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """The stable name of a KV dtype (`torch.bfloat16` -> `"bfloat16"`)."""
    name = (dtype if isinstance(dtype, str) else str(dtype)).removeprefix("torch.")
    if name not in _ITEMSIZES:
        raise KVConfigError(f"unsupported KV dtype {dtype!r}; one of {sorted(_ITEMSIZES)}")
    return name


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of one KV page. `dtype` is kept as its stable name (see `dtype_name`)."""

    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for field in ("page_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise KVConfigError(f"KVLayout.{field} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # a page's dtype: only where pages are

        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """`(2, num_layers, page_size, num_kv_heads, head_dim)`: K/V, layers, tokens, heads, dim."""
        return (2, self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_numel(self) -> int:
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim

    @property
    def page_nbytes(self) -> int:
        return self.page_numel * self.itemsize

    def fingerprint(self) -> str:
        """A short stable name of the layout, used to keep incompatible pages apart on disk."""
        return f"p{self.page_size}-l{self.num_layers}-h{self.num_kv_heads}-d{self.head_dim}-{self.dtype}"

    def check_page(self, page: torch.Tensor) -> torch.Tensor:
        """Return `page` if it is one page of this layout (any device), else raise `KVLayoutError`.

        A page given flat as `page_nbytes` uint8 bytes is accepted and viewed as the page shape.
        """
        import torch

        if page.dtype == torch.uint8 and self.dtype != "uint8" and page.numel() == self.page_nbytes:
            if not page.is_contiguous():
                raise KVLayoutError("a raw-byte page must be contiguous")
            return page.view(self.torch_dtype).view(self.page_shape)
        if page.dtype != self.torch_dtype:
            raise KVLayoutError(f"page dtype {page.dtype} does not match layout dtype {self.dtype}")
        if tuple(page.shape) != self.page_shape:
            if page.numel() == self.page_numel and page.is_contiguous():
                return page.view(self.page_shape)
            raise KVLayoutError(f"page shape {tuple(page.shape)} does not match layout {self.page_shape}")
        return page

    def to_dict(self) -> dict[str, int | str]:
        return {
            "page_size": self.page_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, data: dict[str, int | str]) -> KVLayout:
        try:
            return cls(
                page_size=int(data["page_size"]),
                num_layers=int(data["num_layers"]),
                num_kv_heads=int(data["num_kv_heads"]),
                head_dim=int(data["head_dim"]),
                dtype=str(data["dtype"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise KVConfigError(f"not a KV layout: {data!r}") from exc
