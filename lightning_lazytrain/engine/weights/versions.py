"""Which version of each unit's host weights is current, and whether they may be read now.

An optimizer update on a worker thread writes a unit's masters and its streamed copy; until it has finished
nothing may copy or read them, so the update path ``hold``s the unit with the update's future and every reader
(``refresh``, a gradient sink about to overwrite the gradients the update reads) waits for it first. The time the
main thread spends waiting is what the next step could not hide of the update (``take_wait_seconds``).

``generation[i]`` counts the versions unit ``i`` has had: a device copy (a weight slot, the resident unit, the
evaluation buffer) remembers the generation it copied and is stale once that moved. Masters changed in place (a
checkpoint load, a user's optimizer step) leave the streamed copy behind until ``refresh`` casts it again.

The units themselves (``store.ParamUnit``) describe only the layout; this is the one place that state lives.
"""

from __future__ import annotations

import time
from typing import Protocol

from lightning_lazytrain.engine.weights.layout import ParamUnit


class PendingUpdate(Protocol):
    """An update still writing a unit: a worker's ``Future``, or a device update's ``CopiedOut``."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> object: ...


class WeightVersions:
    def __init__(self, units: list[ParamUnit], stale: bool) -> None:
        """``stale``: whether the streamed copies still have to be written from the masters."""
        self.units = units
        self.generation = [0] * len(units)
        self._stale = [stale] * len(units)
        self._pending: list[PendingUpdate | None] = [None] * len(units)
        self._waited_s = 0.0

    def hold(self, unit: ParamUnit, update: PendingUpdate) -> None:
        """Nothing reads ``unit`` until ``update`` (which writes its masters and streamed copy) has finished."""
        self.wait(unit)
        self._pending[unit.index] = update

    def wait(self, unit: ParamUnit, timeout_s: float = 600.0) -> None:
        """Block until the update ``unit`` is held by has finished (re-raising its error)."""
        future, self._pending[unit.index] = self._pending[unit.index], None
        if future is None:
            return
        if not future.done():
            start = time.perf_counter()
            future.result(timeout=timeout_s)
            self._waited_s += time.perf_counter() - start
        else:
            future.result()

    def wait_all(self, timeout_s: float = 600.0) -> None:
        for unit in self.units:
            self.wait(unit, timeout_s)

    def written(self, unit: ParamUnit) -> None:
        """An update wrote ``unit``'s masters and streamed copy (or its shard of them): device copies are stale."""
        self.generation[unit.index] += 1
        self._stale[unit.index] = False

    def masters_changed(self) -> None:
        """Every unit's masters changed in place: the streamed copies are stale until refreshed."""
        self._stale = [True] * len(self.units)

    def refresh(self, unit: ParamUnit) -> int:
        """Make ``unit``'s streamed copy current (wait for its update, cast the masters where they changed) and
        return its generation, which a device copy of it compares with."""
        self.wait(unit)
        if self._stale[unit.index]:
            if unit.stream.data_ptr() != unit.master.data_ptr():
                unit.stream[: unit.trainable_numel].copy_(unit.master)  # frozen parameters live in the stream copy
            self.generation[unit.index] += 1
            self._stale[unit.index] = False
        return self.generation[unit.index]

    def take_wait_seconds(self) -> float:
        """Seconds spent waiting for updates since the last call."""
        waited, self._waited_s = self._waited_s, 0.0
        return waited
