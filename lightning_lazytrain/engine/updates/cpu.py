"""The optimizer update, one unit at a time on a worker thread, ordered for the next forward.

Units are queued in the order the next forward needs them (embedding/head first, then layer 0, 1, ...), so the
forward of layer ``i`` only waits for update ``i`` while later updates still run: the CPU update hides behind the
GPU's next forward. Each job first waits for its unit's gradient copy, then runs the fused update, which also writes
the bf16 streamed copy; ``WeightVersions.written`` then tells the weight slots their copy is stale, and every reader
of the unit waits for the job first (``WeightVersions.hold``). Units updated on the GPU (``device.py``) are queued
on its streams by the main thread instead, in the same order, and held until their copy out has ended.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lightning_lazytrain.engine.device import host_wait
from lightning_lazytrain.engine.grads.handoff import HandoffSink
from lightning_lazytrain.engine.updates.device import CopiedOut, DeviceUpdateQueue
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.engine.weights.versions import WeightVersions
from lightning_lazytrain.optim import managed_ids


class UnitUpdateQueue:
    """The worker thread and the ordering shared by every update queue; subclasses say what one unit's job is."""

    def __init__(self, optimizer: torch.optim.Optimizer, versions: WeightVersions, sink: HandoffSink,
                 timeout_s: float) -> None:
        self.optimizer = optimizer
        self.versions = versions  # the store's: a queued job holds its unit until it has written it
        self.units = versions.units
        self.sink = sink  # the path's sink: it hands each unit's gradients over (``grads/handoff.py``)
        self.timeout_s = timeout_s
        self._busy: list[tuple[int, float, float]] = []  # (unit index, start, end) of each job since the last take
        self._busy_lock = threading.Lock()  # workers add while the main thread takes and resets
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-update")
        # the optimizer's state dict, read during the run, holds the states after the step just taken
        self._state_hook = optimizer.register_state_dict_pre_hook(lambda _: self.wait_all())

    def _submit(self, coef: float) -> None:
        """Queue ``_run(unit, coef, lr_of)`` for every unit with fresh gradients, in forward order, each after the
        unit's previous update; the learning rates are read now, so a scheduler stepping meanwhile cannot leak in."""
        lr_of = {id(group): group["lr"] for group in self.optimizer.param_groups}
        for unit in self.units:
            grads = self.sink.of(unit)
            if not grads.fresh:
                continue
            grads.fresh = False
            self.versions.hold(unit, self._start(unit, coef, lr_of))

    def _start(self, unit: ParamUnit, coef: float, lr_of: dict[int, float]) -> Future | CopiedOut:
        """Begin ``unit``'s update: here, queue its job on the worker."""
        return self._pool.submit(self._timed, unit, coef, lr_of)

    def _timed(self, unit: ParamUnit, coef: float, lr_of: dict[int, float]) -> None:
        # the worker's own time (gradient wait included): with the versions' wait it says how much was hidden
        start = time.perf_counter()
        try:
            self._run(unit, coef, lr_of)
        finally:
            self._add_busy(unit, start)

    def _add_busy(self, unit: ParamUnit, start: float) -> None:
        with self._busy_lock:
            self._busy.append((unit.index, start, time.perf_counter()))

    def take_busy_seconds(self) -> tuple[float, float]:
        """(CPU worker, device share) host seconds spent on updates since the last call: the time at least one job
        of the CPU worker ran, and the main thread's time queuing the device share's updates."""
        with self._busy_lock:
            busy, self._busy = self._busy, []
        on_device = [self.sink.grads[i].on_device for i, _, _ in busy]
        cpu = covered_seconds([(a, b) for (_, a, b), dev in zip(busy, on_device) if not dev])
        device = covered_seconds([(a, b) for (_, a, b), dev in zip(busy, on_device) if dev])
        return cpu, device

    def _run(self, unit: ParamUnit, coef: float, lr_of: dict[int, float]) -> None:
        raise NotImplementedError

    def wait_all(self) -> None:
        self.versions.wait_all(self.timeout_s)

    def host_state_changed(self) -> None:
        """Masters or optimizer states were loaded into the host tensors: copies held elsewhere must be refreshed
        (none here: the CPU worker updates the host tensors themselves)."""

    def close(self) -> None:
        self.wait_all()
        self._state_hook.remove()
        self._pool.shutdown(wait=True)
        self._close_paths()

    def _close_paths(self) -> None:
        """Release what a subclass holds beyond the worker (after every update has finished)."""


class UpdateQueue(UnitUpdateQueue):
    """Units updated by ``optimizer.step_params`` on the CPU worker; with a ``DeviceUpdateQueue``, the units it
    holds are queued on the GPU's streams by the main thread as the step is scheduled, and run beside the CPU's."""

    def __init__(self, optimizer: torch.optim.Optimizer, versions: WeightVersions, sink: HandoffSink,
                 timeout_s: float, device_queue: DeviceUpdateQueue | None = None) -> None:
        super().__init__(optimizer, versions, sink, timeout_s)
        managed = managed_ids(optimizer)
        self._params = {
            u.index: [(i, e.param) for i, e in enumerate(u.unique) if id(e.param) in managed] for u in self.units
        }
        self.device_queue = device_queue

    def enqueue(self, clip_coef: float) -> None:
        self._submit(clip_coef)

    def wait_all(self) -> None:
        super().wait_all()
        if self.device_queue is not None:
            self.device_queue.drain()  # resident units' masters and states are written back once their jobs end

    def host_state_changed(self) -> None:
        super().wait_all()  # not drained: the load's host tensors win over what the device holds
        if self.device_queue is not None:
            self.device_queue.host_state_changed()

    def _chosen(self, unit: ParamUnit) -> list[tuple[int, torch.Tensor]]:
        return [(i, p) for i, p in self._params[unit.index] if p.requires_grad]

    def _start(self, unit: ParamUnit, coef: float, lr_of: dict[int, float]) -> Future | CopiedOut:
        handoff = self.sink.of(unit)
        if handoff.pieces is not None:  # a staged gradient home: its pieces are staged ahead of the job
            self.sink.stage(unit)
        if not handoff.on_device or self.device_queue is None:
            return super()._start(unit, coef, lr_of)
        start = time.perf_counter()
        chosen = self._chosen(unit)
        kept, handoff.kept = handoff.kept or [None] * len(unit.unique), None
        pending = self.device_queue.launch(unit, [p for _, p in chosen], [kept[i] for i, _ in chosen], handoff.ready,
                                          coef, lr_of)
        self.versions.written(unit)  # readers wait for ``pending`` before they read the new version
        self._add_busy(unit, start)
        return pending

    def _run(self, unit: ParamUnit, clip_coef: float, lr_of: dict[int, float]) -> None:
        chosen = self._chosen(unit)
        handoff = self.sink.of(unit)
        if handoff.staged is not None:
            staged, handoff.staged = handoff.staged, None
            self._run_staged(unit, chosen, staged, clip_coef, lr_of)
        else:
            host_wait(handoff.ready, f"the gradient copy of {unit.label}", self.timeout_s)
            self._step(unit, chosen, handoff.host, 0, clip_coef, lr_of)
        self.versions.written(unit)

    def _run_staged(self, unit: ParamUnit, chosen: list[tuple[int, torch.Tensor]], staged: list[Future],
                    clip_coef: float, lr_of: dict[int, float]) -> None:
        """Update ``unit`` piece by piece from the staging buffers the sink fills ahead of it
        (``grads/staging.py``), handing each buffer back once its piece is updated."""
        pending = list(zip(self.sink.of(unit).pieces, staged, strict=True))
        try:
            while pending:
                piece, future = pending.pop(0)
                buffer, (data, event) = future.result(timeout=self.timeout_s)
                try:
                    host_wait(event, f"the gradient staging of {unit.label}", self.timeout_s)
                    members = set(piece)
                    start = unit.unique[piece[0]].offset
                    self._step(unit, [(i, p) for i, p in chosen if i in members], data, start, clip_coef, lr_of)
                finally:
                    self.sink.staging.release(buffer)
        finally:
            for _, future in pending:  # a failed piece: the buffers staged after it go back too
                if future.exception(timeout=self.timeout_s) is None:
                    self.sink.staging.release(future.result()[0])

    def _step(self, unit: ParamUnit, chosen: list[tuple[int, torch.Tensor]], flat: torch.Tensor, start: int,
              clip_coef: float, lr_of: dict[int, float]) -> None:
        """``step_params`` over ``chosen`` (indices into ``unit.unique``, parameters) with gradients viewed from
        ``flat``, which holds ``unit``'s flat layout from element ``start`` on."""
        offsets = [unit.unique[i].offset - start for i, _ in chosen]
        grads = [flat[o : o + p.numel()].view(p.shape) for o, (_, p) in zip(offsets, chosen)]
        self.optimizer.step_params([p for _, p in chosen], clip_coef, grads, lr_of)

    def _close_paths(self) -> None:
        if self.device_queue is not None:
            self.device_queue.close()


def covered_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
