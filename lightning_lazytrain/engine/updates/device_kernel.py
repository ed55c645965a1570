"""Which kernel runs a parameter's update on the device, and the device memory that update allocates.

``optim.triton_adamw.fused_step`` (one Triton kernel per parameter, allocating nothing) on CUDA where Triton is
installed and the kernel knows the state layout (``optim.state_layout.fused_layout``), else the torch reference
``optim.reference.reference_step`` (same arguments, same math, about twenty kernels and their temporaries). The
plan's budget leaves room for the largest update's peak (`lightning_lazytrain/planning/update_placement.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from lightning_lazytrain.optim.reference import reference_step
from lightning_lazytrain.optim.state_layout import fused_layout


@cache
def _triton_kernels():
    try:
        from lightning_lazytrain.optim import triton_adamw
    except ImportError:  # no Triton (a CPU build of torch): the torch reference runs the update
        return None
    return triton_adamw


def update_kernel(param: torch.Tensor, state: dict, block: int) -> Callable[..., None]:
    """The function that runs one parameter's update: the fused Triton kernel where it applies, else the torch
    reference (same arguments, same math)."""
    kernels = _triton_kernels() if param.device.type == "cuda" else None
    return kernels.fused_step if kernels is not None and kernels.supports(param, state, block) else reference_step


# device bytes per element of a parameter at the peak of its update: the torch reference's temporaries (fp32
# gradient, decoded moments, new moments, denominator, new weights, int64 code indices), and the fused kernel's
# only allocation, fp32 zeros for a parameter the backward left without a gradient
REFERENCE_WORK_BYTES_PER_ELEMENT = 48
FUSED_WORK_BYTES_PER_ELEMENT = 4


def update_work_bytes(param: torch.Tensor, state: dict, device: torch.device) -> int:
    """Device bytes the update of ``param`` (a host master, with its optimizer ``state``) allocates at its peak when
    it runs on ``device``: which kernel runs there decides (``update_kernel``)."""
    block = state.get("block_size", 0)
    fused = device.type == "cuda" and _triton_kernels() is not None and fused_layout(param.dtype, state, block)
    return param.numel() * (FUSED_WORK_BYTES_PER_ELEMENT if fused else REFERENCE_WORK_BYTES_PER_ELEMENT)
