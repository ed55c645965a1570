"""Which checkpoint mode fits the disk: full state, bf16 weights with 8-bit states, or weights only.

A run keeps ``kept`` checkpoints and writes one more while a save is in flight (saves are atomic: a temporary
file renamed over the last; ``schedule/disk.py``), so a mode fits when ``kept + 1`` of its checkpoints fit the free
space. The modes, per trainable parameter:

- full state: the masters as held (fp32 4 B, 2 B under ``bf16-true``) and the optimizer states as held;
- bf16 weights with 8-bit states: 2 B + 2 B, which is the full state of a ``bf16-true`` run whose optimizer keeps
  8-bit states (``HybridAdamW(eight_bit_fraction=1.0)``): resumable exactly;
- weights only: the masters as held (``ModelCheckpoint(save_weights_only=True)``): not resumable exactly (no
  optimizer or scheduler state).

Each mode says the setting that gives it, so an error can name the modes that fit and how to get them.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_lazytrain.units import GIB

from .disk import checkpoint_bytes

EIGHT_BIT_STATE_BYTES = 2.0  # two 8-bit moments a parameter (their block scales are a rounding error)


@dataclass(frozen=True)
class CheckpointMode:
    name: str
    bytes_each: int  # one checkpoint
    need_bytes: int  # ``kept`` of them and one being saved
    fits: bool
    how: str  # the settings that give it

    def describe(self) -> str:
        return f"{self.name}: {self.need_bytes / GIB:.2f} GiB ({self.bytes_each / GIB:.2f} GiB each) — {self.how}"


def checkpoint_modes(
    num_params: int, precision: str, state_bytes_per_param: float, kept: int, free_bytes: int
) -> list[CheckpointMode]:
    """The three modes for a run of ``num_params`` trainable parameters keeping ``kept`` checkpoints on a disk
    with ``free_bytes`` free, in the order full state, bf16 + 8-bit states, weights only."""
    copies = kept + 1
    sizes = (
        (
            "full state",
            checkpoint_bytes(num_params, precision, state_bytes_per_param),
            "save_weights_only: false (the run as configured)",
        ),
        (
            "bf16 weights with 8-bit states",
            checkpoint_bytes(num_params, "bf16-true", EIGHT_BIT_STATE_BYTES),
            "precision: bf16-true and HybridAdamW(eight_bit_fraction=1.0), save_weights_only: false",
        ),
        (
            "weights only",
            checkpoint_bytes(num_params, precision, 0.0),
            "save_weights_only: true (no optimizer state: not resumable exactly)",
        ),
    )
    return [CheckpointMode(name, each, copies * each, copies * each <= free_bytes, how) for name, each, how in sizes]


def fitting_modes_text(modes: list[CheckpointMode], kept: int) -> str:
    """One sentence naming the modes that fit (or that none does, and what one checkpoint fewer would need)."""
    fitting = [m for m in modes if m.fits]
    if fitting:
        return "checkpoint modes that fit: " + "; ".join(m.describe() for m in fitting)
    smallest = min(modes, key=lambda m: m.bytes_each)
    fewer = (
        f"; keeping {kept - 1} instead of {kept} saves {smallest.bytes_each / GIB:.2f} GiB per mode" if kept > 1 else ""
    )
    return (
        f"no checkpoint mode fits ({kept} kept + 1 being saved); the smallest, {smallest.describe()}{fewer};"
        f" or turn periodic checkpoints off: one weights-only copy (the final export alone) is"
        f" {smallest.bytes_each / GIB:.2f} GiB"
    )
