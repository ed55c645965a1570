"""Disk a run's checkpoints need: a full-state checkpoint is the masters plus the optimizer states.

Saves are atomic (a temporary file renamed over the last one) and Lightning removes the previous checkpoint only
after the next is written, so one checkpoint more than those kept exists while one is being saved.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from lightning_lazytrain.admission import TierUsage


def checkpoint_bytes(num_params: int, precision: str, optimizer_state_bytes_per_param: float) -> int:
    """One full-state checkpoint: masters (fp32, or bf16 under ``bf16-true``) and optimizer states (0 for a
    weights-only save)."""
    master = 2 if precision == "bf16-true" else 4
    return int(num_params * (master + optimizer_state_bytes_per_param))


def checkpoints_kept(save_top_k: int, save_last: bool | str | None, saves: int = 1) -> int:
    """Checkpoint files a ``ModelCheckpoint`` keeps between saves: its top k (``-1``: every one of its ``saves``)
    and ``last.ckpt``, which is a copy under ``save_last=True`` but, under ``"link"``, a symlink to the newest top-k
    file (no bytes of its own) unless there is no top-k file to point to (``save_top_k=0``)."""
    kept = max(1, saves) if save_top_k == -1 else save_top_k
    if save_last is True or (save_last == "link" and save_top_k == 0):
        kept += 1
    return kept


def free_bytes(path: str) -> int:
    """Free space of the filesystem ``path`` is on, or will be created on (its nearest existing parent)."""
    target = Path(path).expanduser().absolute()
    while not target.exists():
        target = target.parent
    return shutil.disk_usage(target).free


def checkpoint_tier(
    num_params: int, precision: str, optimizer_state_bytes_per_param: float, kept: int, free_bytes: int
) -> TierUsage:
    """``kept`` checkpoints on disk, and one more while the next is being saved (weights-only ones when
    ``optimizer_state_bytes_per_param`` is 0)."""
    one = checkpoint_bytes(num_params, precision, optimizer_state_bytes_per_param)
    kind = "full-state" if optimizer_state_bytes_per_param else "weights-only"
    piece = f"{kept + 1} {kind} checkpoints ({kept} kept, 1 being saved)"
    return TierUsage("checkpoint disk", int(free_bytes), {piece: (kept + 1) * one})
