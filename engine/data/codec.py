"""Encoding of wire messages (msgpack) and of tensors (header + raw bytes).

Messages: `WireCodec` encodes any `engine.data.wire.Message` to msgpack and decodes bytes
back into exactly one of them, raising a typed `WireError` (with the `ErrorCode` to send
back) for oversized, malformed or unknown input. Nothing here pickles.

Tensors: `flatten_tensor` turns a numpy array or a torch tensor into a `TensorHeader` and a
flat byte view of C-contiguous memory; `TensorData` turns a header and a buffer back into a
numpy array or a torch tensor without copying. torch is imported only when a torch tensor
is involved, so the wire path runs without it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from engine.data.wire import ErrorCode, Message, TensorHeader, Transport

if TYPE_CHECKING:
    import torch

KiB = 1 << 10
MiB = 1 << 20

# Names on the wire -> bytes per element. numpy and torch agree on these names; the last
# group exists in torch only and is read through a uint8 view.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
TORCH_ONLY_DTYPES = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})


class WireError(Exception):
    """A message or tensor that cannot be read; `code` is what the peer is told."""

    code: ErrorCode = ErrorCode.MALFORMED


class MalformedMessage(WireError):
    code = ErrorCode.MALFORMED


class UnknownMessage(WireError):
    code = ErrorCode.UNKNOWN_MESSAGE


class OversizedMessage(WireError):
    code = ErrorCode.OVERSIZED


class UnsupportedTensor(WireError):
    """A dtype the wire cannot carry, or a conversion the target library cannot do."""

    code = ErrorCode.UNSUPPORTED


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits of one endpoint. A request above `max_request_bytes` gets an OVERSIZED
    error reply; a single message above `hard_max_message_bytes` makes ZeroMQ drop the
    connection before it is read (protection against memory exhaustion)."""

    max_request_bytes: int = 64 * KiB
    max_chunk_bytes: int = 16 * MiB
    hard_max_message_bytes: int = 256 * MiB


class _TagOnly(msgspec.Struct):
    type: str


class WireCodec:
    """msgpack for a tagged message union (`Message` of the transfer plane by default,
    `WorkerMessage` for role workers). One instance per thread (encoders and decoders keep
    internal buffers)."""

    __slots__ = ("_decoder", "_encoder", "_known_tags", "_max_bytes", "_tag_decoder")

    def __init__(self, max_message_bytes: int, union: Any = Message) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)
        self._tag_decoder = msgspec.msgpack.Decoder(_TagOnly)
        self._known_tags = frozenset(t.__name__ for t in union.__args__)
        self._max_bytes = max_message_bytes

    def encode(self, message: Message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> Message:
        if len(data) > self._max_bytes:
            raise OversizedMessage(f"message of {len(data)} bytes exceeds the limit of {self._max_bytes}")
        try:
            return self._decoder.decode(data)
        except msgspec.ValidationError as exc:
            raise self._classify(data, exc) from exc
        except msgspec.DecodeError as exc:
            raise MalformedMessage(f"not a msgpack message: {exc}") from exc

    def _classify(self, data: bytes | memoryview, exc: msgspec.ValidationError) -> WireError:
        try:
            tag = self._tag_decoder.decode(data).type
        except (msgspec.ValidationError, msgspec.DecodeError):
            return MalformedMessage(f"message without a type tag: {exc}")
        if tag not in self._known_tags:
            return UnknownMessage(f"unknown message type {tag!r}")
        return MalformedMessage(f"invalid {tag}: {exc}")


# --- tensors -----------------------------------------------------------------------------


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def check_header(header: TensorHeader, max_nbytes: int | None = None) -> None:
    """Validate a header read from a peer; raises `MalformedMessage` / `OversizedMessage`."""
    itemsize = DTYPE_SIZES.get(header.dtype)
    if itemsize is None:
        raise MalformedMessage(f"unknown dtype {header.dtype!r}")
    if any(d < 0 for d in header.shape) or header.offset < 0:
        raise MalformedMessage("negative dimension or offset")
    if header.strides != contiguous_strides(header.shape):
        raise MalformedMessage("protocol version 1 carries C-contiguous tensors only")
    if header.nbytes != math.prod(header.shape) * itemsize:
        raise MalformedMessage(f"nbytes {header.nbytes} does not match {header.dtype}{list(header.shape)}")
    if max_nbytes is not None and header.nbytes > max_nbytes:
        raise OversizedMessage(f"tensor of {header.nbytes} bytes exceeds the limit of {max_nbytes}")


@dataclass(frozen=True, slots=True)
class FlatTensor:
    """A tensor as the wire sees it: a header and its C-contiguous bytes (`data`, uint8, 1-D).

    `data` aliases the caller's tensor when it was already contiguous, CPU and native-endian;
    otherwise it is a private copy (`copied` is True). `device` is where the tensor lived."""

    header: TensorHeader
    data: np.ndarray
    copied: bool
    device: str


def _is_torch_tensor(value: object) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage")


def flatten_tensor(value: np.ndarray | torch.Tensor) -> FlatTensor:
    """Header and flat bytes of a numpy array or torch tensor.

    Copies (documented, once) when the input is not C-contiguous, not native-endian, or on a
    GPU: a CUDA tensor is staged to host memory (a store keeps one on its GPU instead and
    serves it by CUDA IPC; see `engine.data.tensor_store`).
    """
    if _is_torch_tensor(value):
        return _flatten_torch(value)
    if not isinstance(value, np.ndarray):
        raise UnsupportedTensor(f"expected a numpy array or a torch tensor, got {type(value).__name__}")
    array = value
    copied = False
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
        copied = True
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
        copied = True
    name = array.dtype.name
    if name not in DTYPE_SIZES:
        raise UnsupportedTensor(f"dtype {array.dtype} cannot travel on the wire")
    shape = tuple(int(d) for d in array.shape)
    header = TensorHeader(name, shape, contiguous_strides(shape), int(array.nbytes))
    return FlatTensor(header, array.reshape(-1).view(np.uint8), copied, "cpu")


def _flatten_torch(tensor: torch.Tensor) -> FlatTensor:
    import torch

    device = str(tensor.device)
    copied = False
    if tensor.device.type != "cpu":
        tensor = tensor.detach().to("cpu")
        copied = True
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
        copied = True
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise UnsupportedTensor(f"dtype {tensor.dtype} cannot travel on the wire")
    shape = tuple(int(d) for d in tensor.shape)
    header = TensorHeader(name, shape, contiguous_strides(shape), tensor.numel() * tensor.element_size())
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        data = np.empty(0, np.uint8)
    else:
        data = flat.view(torch.uint8).numpy()
    return FlatTensor(header, data, copied, device)


@dataclass(frozen=True, slots=True)
class TensorData:
    """A received tensor: `header` over `buffer` (any buffer-protocol object, kept alive here),
    or a CUDA tensor (`buffer` is the tensor itself: CUDA_IPC, or LOCAL from a store in this
    process).

    Ownership depends on `transport`: SHM data is a read-only view of the producer's segment,
    valid while the ref's lease is held (copy it to keep it longer); TCP and INLINE data is
    private to the consumer; CUDA_IPC data is the producer's GPU memory, kept allocated while
    this mapping lives but only while the producer process does (clone it to outlive that).
    `torch()` never copies unless asked to; `numpy()` and `bytes_view()` of a CUDA tensor copy
    it to host memory."""

    header: TensorHeader
    buffer: Any
    transport: Transport

    @property
    def nbytes(self) -> int:
        return self.header.nbytes

    @property
    def on_gpu(self) -> bool:
        return _is_torch_tensor(self.buffer)

    def bytes_view(self) -> np.ndarray:
        """The raw bytes, uint8, 1-D, no copy (a copy in host memory for a CUDA tensor)."""
        if self.on_gpu:
            import torch

            return self.buffer.detach().reshape(-1).view(torch.uint8).cpu().numpy()
        raw = np.frombuffer(self.buffer, np.uint8, self.header.nbytes, self.header.offset)
        return raw

    def numpy(self, copy: bool = False) -> np.ndarray:
        if self.header.dtype in TORCH_ONLY_DTYPES:
            raise UnsupportedTensor(f"numpy has no {self.header.dtype}; use .torch()")
        array = self.bytes_view().view(np.dtype(self.header.dtype)).reshape(self.header.shape)
        return array.copy() if copy else array

    def torch(self, copy: bool = False) -> torch.Tensor:
        """A torch tensor over the same bytes: on the CPU, or the CUDA tensor itself. A SHM view
        is mapped read-only: writing to it in place faults, so pass `copy=True` (or clone)
        before mutating it; a CUDA_IPC tensor is the producer's memory, shared with it."""
        import torch

        if self.on_gpu:
            return self.buffer.clone() if copy else self.buffer
        dtype = getattr(torch, self.header.dtype)
        if self.header.nbytes == 0:
            return torch.empty(self.header.shape, dtype=dtype)
        raw = self.bytes_view()
        if copy:
            raw = raw.copy()
        with warnings.catch_warnings():
            # Read-only mappings are intentional (see the docstring); torch warns about them.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(raw)
        return flat.view(dtype).reshape(self.header.shape)
