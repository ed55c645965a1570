"""Disk a run's checkpoints need: a full-state checkpoint is the masters plus the optimizer states.

Saves are atomic (a temporary file renamed over the last one) and Lightning removes the previous checkpoint only
after the next is written, so two full checkpoints exist while one is being saved.
"""

from __future__ import annotations

from .admission import TierUsage


def checkpoint_bytes(num_params: int, precision: str, optimizer_state_bytes_per_param: float) -> int:
    """One full-state checkpoint: masters (fp32, or bf16 under ``bf16-true``) and optimizer states."""
    master = 2 if precision == "bf16-true" else 4
    return int(num_params * (master + optimizer_state_bytes_per_param))


def checkpoint_tier(
    num_params: int, precision: str, optimizer_state_bytes_per_param: float, kept: int, free_bytes: int
) -> TierUsage:
    """``kept`` checkpoints on disk, and one more while the next is being saved."""
    one = checkpoint_bytes(num_params, precision, optimizer_state_bytes_per_param)
    piece = f"{kept + 1} full-state checkpoints ({kept} kept, 1 being saved)"
    return TierUsage("checkpoint disk", int(free_bytes), {piece: (kept + 1) * one})
