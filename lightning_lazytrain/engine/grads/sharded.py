"""Per-layer gradient reduce-scatter on the device, so each rank moves only its own shard to the host.

As soon as a layer's weight gradients exist they are packed into one flat buffer (the unit's padded layout) and
an asynchronous reduce-scatter (summing) starts on the default group; the backward of the next layer runs while
it is in flight. On CUDA the D2H stream waits for the collective, takes the shard's squared norm and copies the
shard into the unit's pinned host buffer (1/N of the unit); the update job waits on that copy's event. On the CPU
(gloo) the collective writes the host shard directly and runs on gloo's threads; its norm is taken at the step.

The collective sums; the 1/N of the average is folded into the update's gradient scale (``world_size``), and the
norm reported is that of the averaged gradient: ``sum over ranks of |shard|^2 / N^2``, all-reduced once per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_lazytrain.engine.device import DeviceQueues
from lightning_lazytrain.engine.grads.handoff import HandoffSink
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.engine.weights.shared_store import SharedParamStore
from lightning_lazytrain.engine.weights.topology import reduce_scatter_flat
from lightning_lazytrain.optim import grad_norm_sq


class ShardedGradSink(HandoffSink):
    def __init__(self, store: SharedParamStore, queues: DeviceQueues, dtype: torch.dtype) -> None:
        super().__init__(store, queues)
        self.store, self.dtype = store, dtype
        self.world_size = store.topology.world_size
        for unit, lay in zip(store.units, store.layouts):
            self.of(unit).host = store.pinned.empty(lay.shard, dtype)
        self._in_flight: list[tuple[ParamUnit, dist.Work]] = []

    def submit(self, unit: ParamUnit, grads: list[torch.Tensor | None]) -> None:
        self.store.versions.wait(unit)  # its update reads the gradient buffer this overwrites
        lay = self.store.layouts[unit.index]
        handoff = self.of(unit)
        device = self.queues.device
        parts = [torch.zeros(e.numel, dtype=self.dtype, device=device) if g is None else g.reshape(-1).to(self.dtype)
                 for e, g in zip(unit.unique, grads)]
        if lay.padded > lay.numel:
            parts.append(torch.zeros(lay.padded - lay.numel, dtype=self.dtype, device=device))
        flat = torch.cat(parts)
        shard = torch.empty(lay.shard, dtype=self.dtype, device=device) if self.queues.is_cuda else handoff.host
        with self.store.topology.collective(f"the gradient reduce-scatter of {unit.label}"):
            work = reduce_scatter_flat(shard, flat, async_op=True)
        if self.queues.is_cuda:
            with self.queues.on(self.queues.d2h):
                work.wait()  # the D2H stream waits for the collective; the host does not
                self._add_norm(grad_norm_sq([shard]))
                handoff.host.copy_(shard, non_blocking=True)
            handoff.ready = self.queues.record(self.queues.d2h)
            # The collective's buffers must outlive it; the update job drops them once the shard is on the host.
            handoff.refs = [flat, shard]
        else:
            self._in_flight.append((unit, work))
        self.d2h_bytes += lay.shard * handoff.host.element_size()
        handoff.fresh = True

    def take_norm_sq(self) -> float:
        """The squared norm of this step's averaged gradient over all ranks (one all-reduce, one host sync)."""
        in_flight, self._in_flight = self._in_flight, []
        topo = self.store.topology
        for unit, work in in_flight:
            with topo.collective(f"the gradient reduce-scatter of {unit.label}"):
                work.wait()
            self._add_norm(grad_norm_sq([self.of(unit).host]))
        total = self._take_norm()
        if total is None:
            total = torch.zeros((), dtype=torch.float32, device=self.queues.device)
        if self.queues.is_cuda:
            self.queues.wait(self.queues.record(self.queues.d2h))
        total = total.to(self.queues.device)
        with topo.collective("the all-reduce of the gradient norm"):
            dist.all_reduce(total)
        return float(total) / self.world_size**2
