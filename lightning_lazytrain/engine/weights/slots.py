"""A fixed pool of device buffers that decoder layers stream into, with events for ready and free.

Each slot is one flat buffer sized for the largest layer. A slot remembers which layer (and which generation of
its weights) it holds, so a layer still resident from the end of the forward is reused by the backward without a
second copy, and a layer's weights are copied at most twice per step (forward, backward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_lazytrain.engine.device import DeviceQueues
from lightning_lazytrain.engine.weights.layout import ParamUnit, aligned_numel
from lightning_lazytrain.engine.weights.versions import WeightVersions


class SlotPoolExhaustedError(RuntimeError):
    """More layers were asked to be resident at once than the pool has slots (a planning bug)."""


@dataclass
class Slot:
    index: int
    buffer: torch.Tensor
    unit: ParamUnit | None = None
    generation: int = -1
    holders: int = 0
    pending: bool = False
    last_use: int = 0
    ready: torch.cuda.Event | None = None
    free: torch.cuda.Event | None = None

    def holds(self, unit: ParamUnit, generation: int) -> bool:
        return self.unit is unit and self.generation == generation

    def views(self, unit: ParamUnit) -> list[torch.Tensor]:
        """One tensor per distinct parameter of ``unit`` (``unit.unique`` order), viewing this slot's buffer."""
        return [e.view_in(self.buffer) for e in unit.unique]


class SlotPool:
    def __init__(self, queues: DeviceQueues, versions: WeightVersions, num_slots: int, slot_numel: int,
                 dtype: torch.dtype) -> None:
        self.queues, self.versions = queues, versions
        # One allocation for all slots: the allocator rounds each separate tensor up to its block size (2 MiB),
        # which made many small slots take far more memory than the admission check counted.
        # Each slot is its own tensor over that storage (set_, not a view): views would share one version counter,
        # and a copy into one slot would then invalidate the autograd graph that saved another slot's weights.
        # Slots start on 16-byte boundaries, where the 4-bit parts of a unit's layout expect them.
        stride = aligned_numel(slot_numel, dtype.itemsize)
        storage = torch.empty(num_slots * stride, dtype=dtype, device=queues.device).untyped_storage()
        self.slots = [
            Slot(i, torch.empty(0, dtype=dtype, device=queues.device).set_(storage, i * stride, (slot_numel,)))
            for i in range(num_slots)
        ]
        self.slot_numel = slot_numel
        self._clock = 0
        self.h2d_copies = 0
        self.h2d_bytes = 0

    @property
    def nbytes(self) -> int:
        return sum(s.buffer.numel() * s.buffer.element_size() for s in self.slots)

    def _find(self, unit: ParamUnit) -> Slot | None:
        generation = self.versions.refresh(unit)
        for slot in self.slots:
            if slot.holds(unit, generation):
                return slot
        return None

    def has_room(self) -> bool:
        return any(s.holders == 0 and not s.pending for s in self.slots)

    def acquire(self, unit: ParamUnit) -> Slot:
        """Hold a slot containing ``unit``'s current weights, starting the copy if it is not resident yet.

        The copy is queued on the H2D stream behind the slot's free event; the caller makes the compute stream wait
        on ``slot.ready`` before use. The host never blocks here.
        """
        self._clock += 1
        slot = self._find(unit)
        if slot is None:
            slot = self._evict()
            self._load(slot, unit)
        slot.holders += 1
        slot.pending = False
        slot.last_use = self._clock
        return slot

    def prefetch(self, unit: ParamUnit) -> bool:
        """Start loading ``unit`` into a free slot if one exists; returns whether it is (or is being) resident."""
        if self._find(unit) is not None:
            return True
        if not self.has_room():
            return False
        self._clock += 1
        slot = self._evict()
        self._load(slot, unit)
        slot.pending = True
        slot.last_use = self._clock
        return True

    def prefetcher(self, units: list[ParamUnit], depth: int) -> Callable[[int], None]:
        """A function ``prefetch(pos)`` that starts the copies of the ``depth`` units after position ``pos`` of
        ``units`` (the order the stack will acquire them in), stopping at the first that finds no free slot."""

        def prefetch(pos: int) -> None:
            for unit in units[pos : pos + depth]:
                if not self.prefetch(unit):
                    break

        return prefetch

    def release(self, slot: Slot) -> None:
        """The compute stream is done with ``slot`` once what is queued now has run."""
        slot.holders -= 1
        if slot.holders == 0:
            slot.free = self.queues.record()

    def _evict(self) -> Slot:
        free = [s for s in self.slots if s.holders == 0 and not s.pending] or [s for s in self.slots if s.holders == 0]
        if not free:
            held = ", ".join(s.unit.label for s in self.slots if s.unit is not None)
            raise SlotPoolExhaustedError(f"all {len(self.slots)} weight slots are held ({held})")
        return min(free, key=lambda s: (s.unit is not None, s.last_use))

    def _load(self, slot: Slot, unit: ParamUnit) -> None:
        h2d = self.queues.h2d
        self.queues.wait(slot.free, h2d)
        with self.queues.on(h2d), torch.inference_mode(False):
            slot.buffer[: unit.numel].copy_(unit.stream, non_blocking=True)
        slot.ready = self.queues.record(h2d)
        slot.unit, slot.generation = unit, self.versions.generation[unit.index]
        self.h2d_copies += 1
        self.h2d_bytes += unit.numel * unit.stream.element_size()

    def invalidate(self) -> None:
        for slot in self.slots:
            slot.unit, slot.generation, slot.pending = None, -1, False
