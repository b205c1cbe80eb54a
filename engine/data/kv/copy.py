"""Page copies that run at memcpy speed on the CPU.

torch's CPU `copy_` splits large copies over its OpenMP threads, and those threads
spin and stall when another process holds a core: on a small shared machine a 2 MiB
page copy then takes milliseconds instead of ~100 us. A page is contiguous, so a
CPU-to-CPU copy is a plain `memcpy` of its bytes, done here single-threaded through
numpy (which also releases the GIL). Anything involving a GPU goes through torch.
"""

from __future__ import annotations

import numpy as np
import torch


def byte_array(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 numpy array (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def copy_page(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one page's bytes from `src` into `dst` (same dtype and shape)."""
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.numel() == src.numel()
    ):
        np.copyto(byte_array(dst), byte_array(src))
    else:
        dst.copy_(src)
