"""What the direct and sharded sinks hand to the update job, unit by unit, and the norm they sum on the way.

The per-unit record (``UnitGrads``) belongs to the sink: the sink writes it in the backward, the update job of the
same path reads it, and nothing else does (``ParamUnit`` describes the parameter layout only). The squared
gradient norm is summed on the device as the layers go and read once per step, for clipping and the non-finite
check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_lazytrain.engine.device import DeviceQueues
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.engine.weights.store import HostParamStore


@dataclass
class UnitGrads:
    """One unit's gradients of this step, on their way to its update."""

    host: torch.Tensor | None = None  # pinned host buffer in the compute dtype (this rank's shard with several)
    ready: object = None  # event: the copy into ``host`` (on the device: the backward) is complete
    refs: list | None = None  # the sharded sink's collective buffers the copy still reads; dropped once it is done
    fresh: bool = False  # gradients arrived since the unit's last update was queued
    on_device: bool = False  # updated on the GPU (``updates/device.py``): gradients kept on the device
    kept: list | None = None  # those device gradients (or the device home's), aligned with ``unit.unique``
    pieces: list[list[int]] | None = None  # staged homes (``homes.py``): the unit's pieces, staged one by one
    written: list | None = None  # nvme home: per piece, the future of its write to the spill file
    staged: list | None = None  # staged homes, at the update: per piece, the future of its staging buffer


class HandoffSink:
    """Base of the direct and sharded sinks: one ``UnitGrads`` per unit and the device-side norm sum."""

    def __init__(self, store: HostParamStore, queues: DeviceQueues) -> None:
        self.store, self.queues = store, queues
        self.d2h_bytes = 0
        self.grads = {unit.index: UnitGrads() for unit in store.units}
        self._norm_sq: torch.Tensor | None = None

    def of(self, unit: ParamUnit) -> UnitGrads:
        return self.grads[unit.index]

    def _add_norm(self, norm_sq: torch.Tensor) -> None:
        self._norm_sq = norm_sq if self._norm_sq is None else self._norm_sq + norm_sq

    def _take_norm(self) -> torch.Tensor | None:
        total, self._norm_sq = self._norm_sq, None
        return total

    def take_norm_sq(self) -> float:
        raise NotImplementedError

    def held_bytes(self) -> int:
        """Host bytes of the gradient buffers (for admission)."""
        return sum(g.host.numel() * g.host.element_size() for g in self.grads.values() if g.host is not None)

    def flush(self) -> None:
        """Nothing to wait for here: each update waits for its own unit's copy."""

    def forget(self) -> None:
        """A skipped step: no unit has gradients to update from."""
        for grads in self.grads.values():
            grads.fresh = False

    def discard(self) -> None:
        """Forget a failed step's gradients and norm; the device tensors they came from may be freed."""
        self.take_norm_sq()
        self.forget()
        for grads in self.grads.values():
            grads.kept = grads.refs = grads.staged = None

    def close(self) -> None:
        for grads in self.grads.values():
            grads.host = grads.refs = grads.kept = grads.staged = None
