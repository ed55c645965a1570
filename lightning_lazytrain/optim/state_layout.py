"""Which tensors of a HybridAdamW get 8-bit moments, and the moment tensors each starts with.

Decided once, at construction, over all groups:
  * tensors with fewer than ``min_8bit_numel`` elements always keep fp32 moments (norms, biases: tiny, sensitive);
  * ``eight_bit_fraction >= 1``: every other tensor is 8-bit;
  * otherwise tensors are visited largest first (ties: construction order) and one goes 8-bit when the 8-bit
    element count stays <= ``eight_bit_fraction`` x (all elements); smaller tensors may fill what larger ones
    could not, so the realised fraction is as close to the target as tensor granularity allows, never above it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .reference import mix32

__all__ = ["STATE_TENSORS", "choose_8bit", "init_state", "defer_state_allocation", "fused_layout"]

STATE_TENSORS = ("exp_avg", "exp_avg_sq", "exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax")
_deferred = threading.local()


def choose_8bit(params: list[torch.Tensor], eight_bit_fraction: float, min_8bit_numel: int) -> set[int]:
    """Indices into ``params`` of the tensors whose moments are 8-bit."""
    eligible = [i for i, p in enumerate(params) if p.numel() >= min_8bit_numel]
    if eight_bit_fraction >= 1.0:
        return set(eligible)
    budget = eight_bit_fraction * sum(p.numel() for p in params)
    chosen, used = set(), 0
    for i in sorted(eligible, key=lambda i: (-params[i].numel(), i)):
        if used + params[i].numel() <= budget:
            chosen.add(i)
            used += params[i].numel()
    return chosen


def init_state(st: dict, p: torch.Tensor, index: int, eight_bit: bool, block_size: int, seed: int) -> None:
    """Fill ``st``, the fresh state of ``p`` (the ``index``-th parameter over all groups)."""
    st["step"] = 0
    # Per-tensor stochastic-rounding key: fixed by (seed, position), saved, so a resume rounds identically.
    st["sr_key"] = int(mix32((seed * 0x9E3779B1 + index * 0x85EBCA77 + 1) & 0xFFFFFFFF))
    if getattr(_deferred, "active", False):
        return
    if eight_bit:
        nblk = -(-p.numel() // block_size)
        st["block_size"] = block_size
        st["exp_avg_codes"] = torch.full(p.shape, 127, dtype=torch.uint8, device=p.device)  # code 127 == 0.0
        st["exp_avg_sq_codes"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)  # code 0 == 0.0
        st["exp_avg_absmax"] = torch.zeros(nblk, dtype=torch.float32, device=p.device)
        st["exp_avg_sq_absmax"] = torch.zeros(nblk, dtype=torch.float32, device=p.device)
    else:
        st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)


@contextlib.contextmanager
def defer_state_allocation() -> Iterator[None]:
    """HybridAdamWs built inside (on this thread) allocate no moment tensors.

    For an optimizer that only carries hyperparameters while another one, over shards of its parameters, does the
    updates (several processes): allocating full-size moments on every rank first would need N times the host RAM.
    """
    before = getattr(_deferred, "active", False)
    _deferred.active = True
    try:
        yield
    finally:
        _deferred.active = before


def fused_layout(dtype: torch.dtype, state: dict, block: int) -> bool:
    """Whether ``optim.triton_adamw``'s kernel handles a parameter of ``dtype`` with these state tensors and 8-bit
    ``block`` (contiguous CUDA tensors given): fp32 or bf16 masters; fp32 moments, or 8-bit ones in power-of-two
    blocks of 128 to 8192 elements (one program holds a block). Kept apart from the kernel so that it is known where
    Triton is not."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    if "exp_avg_codes" in state:
        return block & (block - 1) == 0 and 128 <= block <= 8192
    exp_avg = state.get("exp_avg")
    return exp_avg is not None and exp_avg.dtype == torch.float32
