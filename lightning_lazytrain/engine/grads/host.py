"""Gradients from the device into the fp32 host accumulators (``accumulate.py``), off the compute stream and thread.

On CUDA each layer's gradients are packed into a few pinned staging buffers by copies on the D2H stream (after an
event that marks the layer's backward), and one worker thread waits for each copy and adds it into the unit's
fp32 accumulator. The device gradient tensors stay referenced until their copy is known complete, so the caching
allocator cannot hand their memory to the next layer too early. On the CPU the gradients are added directly.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from lightning_lazytrain.engine.device import DeviceQueues, host_wait
from lightning_lazytrain.engine.grads.accumulate import HostAccumulators
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.engine.weights.store import HostParamStore


@dataclass
class _Batch:
    staging: torch.Tensor
    used: int = 0
    # unit, entry (index in unit.unique), destination offset, staging offset, size
    segments: list[tuple[ParamUnit, int, int, int, int]] = field(default_factory=list)
    keep_alive: list[torch.Tensor] = field(default_factory=list)


class GradSink:
    def __init__(
        self,
        store: HostParamStore,
        queues: DeviceQueues,
        staging_numel: int,
        dtype: torch.dtype,
        num_staging: int = 3,
        timeout_s: float = 600.0,
    ) -> None:
        self.store = store
        self.queues = queues
        self.timeout_s = timeout_s
        self.sums = HostAccumulators(store.units, store.master_dtype)
        self._covered: dict[int, set[int]] = {}  # per unit: the entries this backward gave a gradient
        self._units: dict[int, ParamUnit] = {}
        self._futures: list[Future] = []
        self.d2h_bytes = 0
        if queues.is_cuda:
            self._free: queue.Queue[torch.Tensor] = queue.Queue()
            for _ in range(num_staging):
                self._free.put(store.pinned.empty(staging_numel, dtype))
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-grads")
        self._batch: _Batch | None = None

    def submit(self, unit: ParamUnit, grads: list[torch.Tensor | None]) -> None:
        """Hand over one backward's gradients of ``unit`` (aligned with ``unit.unique``; None = no gradient)."""
        if unit.index not in self._covered:
            self.sums.begin(unit)
            self._covered[unit.index] = set()
            self._units[unit.index] = unit
        covered = self._covered[unit.index]
        if not self.queues.is_cuda:
            for i, (entry, grad) in enumerate(zip(unit.unique, grads)):
                if grad is not None:
                    self.sums.add(unit, i, entry.offset, grad.reshape(-1))
                    covered.add(i)
            return
        ready = self.queues.record()
        d2h = self.queues.d2h
        self.queues.wait(ready, d2h)
        for i, (entry, grad) in enumerate(zip(unit.unique, grads)):
            if grad is None:
                continue
            covered.add(i)
            flat = grad.reshape(-1)
            done = 0
            while done < flat.numel():
                batch = self._open_batch()
                take = min(flat.numel() - done, batch.staging.numel() - batch.used)
                with self.queues.on(d2h):
                    batch.staging[batch.used : batch.used + take].copy_(flat[done : done + take], non_blocking=True)
                batch.segments.append((unit, i, entry.offset + done, batch.used, take))
                batch.keep_alive.append(grad)
                batch.used += take
                done += take
                if batch.used == batch.staging.numel():
                    self._ship()
            self.d2h_bytes += flat.numel() * flat.element_size()
        self._ship()

    def _open_batch(self) -> _Batch:
        if self._batch is None:
            try:
                staging = self._free.get(timeout=self.timeout_s)
            except queue.Empty as exc:
                raise TimeoutError(
                    f"lazytrain waited {self.timeout_s:.0f} s for a gradient staging buffer;"
                    " the gradient worker is stuck"
                ) from exc
            self._batch = _Batch(staging)
        return self._batch

    def _ship(self) -> None:
        batch, self._batch = self._batch, None
        if batch is None or not batch.segments:
            if batch is not None:
                self._free.put(batch.staging)
            return
        event = self.queues.record(self.queues.d2h)
        self._futures.append(self._worker.submit(self._land, batch, event))

    def _land(self, batch: _Batch, event: torch.cuda.Event) -> None:
        host_wait(event, "a gradient copy to the host", self.timeout_s)
        batch.keep_alive.clear()
        for unit, entry, dst, src, n in batch.segments:
            self.sums.add(unit, entry, dst, batch.staging[src : src + n])
        self._free.put(batch.staging)

    def flush(self) -> None:
        """Wait until every submitted gradient is in its accumulator, then expose the ``.grad`` views."""
        self._ship()
        futures, self._futures = self._futures, []
        for future in futures:
            future.result(timeout=self.timeout_s)
        for index, covered in self._covered.items():
            self.sums.finish(self._units[index], covered)
        self._covered.clear()
        self._units.clear()

    def held_bytes(self) -> int:
        """Host bytes of the gradient accumulators, for admission (the few staging buffers are not counted)."""
        return self.sums.held_bytes()

    def discard(self) -> None:
        """Forget a failed step's gradients: let the copies in flight land, then drop every ``.grad``."""
        self.flush()
        for unit in self.store.units:
            for entry in unit.unique:
                entry.param.grad = None

    def close(self) -> None:
        if self.queues.is_cuda:
            self._worker.shutdown(wait=True)
