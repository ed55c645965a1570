"""Some units' optimizer updates on the GPU, beside the CPU's (``placement.py`` says which), pipelined over units.

A device unit's gradients stay on the device after the backward (no D2H). Its update moves the fp32 masters and
optimizer states in, runs the same math as the CPU kernel (``optim.reference.reference_step``, from
``HybridAdamW.prepare_update``'s scalars) and moves masters, states and the bf16 stream copy out. The host tensors
stay the only state, so checkpoints and resume see nothing different.

Each phase has its own stream: copies in (H2D), the update, copies out (D2H). Two units are in flight, each in one
of two staging buffers, launched by the two threads of the device worker pool: while unit ``k`` is updated, unit
``k + 1`` is copied in and unit ``k - 1`` copied out, so both directions of the link stay busy (the split in
``placement.py`` assumes this). A staging buffer is handed on with the event of its last copy out, which the next
unit's copies in wait for on the device; the host never blocks there. A unit's job returns, and its
``WeightVersions`` hold ends, only once its own copies out have finished, so no reader sees half-written weights.
"""

from __future__ import annotations

import logging
import queue

import torch

from lightning_lazytrain.engine.device import DeviceQueues, host_wait
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.optim.reference import reference_step

log = logging.getLogger(__name__)

IN_FLIGHT = 2  # units whose update is queued on the device at once: one copied in while one is updated
_ALIGN = 256  # bytes: every staged tensor starts on a fresh DMA-friendly boundary


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def staging_bytes(unit: ParamUnit, optimizer: torch.optim.Optimizer) -> int:
    """Device bytes one staging buffer needs for ``unit``: each parameter's master, state tensors and stream copy."""
    total = 0
    for e in unit.unique:
        states = optimizer.state_tensors(e.param)
        total += _aligned(e.numel * e.param.element_size()) + sum(_aligned(t.nbytes) for t in states)
        total += _aligned(e.numel * 2)  # a bf16 stream copy (counted whether or not one is registered)
    return total


class DeviceUpdatePath:
    """Runs the updates of ``units`` (those assigned to the device), called from ``IN_FLIGHT`` worker threads."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: list[ParamUnit], queues: DeviceQueues,
                 timeout_s: float) -> None:
        self.optimizer, self.queues, self.timeout_s = optimizer, queues, timeout_s
        self.units = units
        cuda = queues.is_cuda
        self.copy_in, self.compute, self.copy_out = ((torch.cuda.Stream(queues.device) for _ in range(3)) if cuda
                                                     else (None, None, None))
        self._registered: list[int] = []
        nbytes = max((staging_bytes(u, optimizer) for u in units), default=0)
        self._staging: queue.Queue = queue.Queue()
        for _ in range(IN_FLIGHT):
            self._staging.put((torch.empty(nbytes, dtype=torch.uint8, device=queues.device), None))
        if cuda:
            for unit in self.units:
                self._pin(unit.master)
                for e in unit.unique:
                    for t in optimizer.state_tensors(e.param):
                        self._pin(t)

    def _pin(self, t: torch.Tensor) -> None:
        """Page-lock ``t`` in place (cudaHostRegister), so the copies in and out are asynchronous DMA."""
        if t.is_pinned() or t.numel() == 0:
            return
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            log.warning("lazytrain: could not pin %d bytes for device updates (CUDA error %s); those copies will be"
                        " synchronous", nbytes, int(err))
            return
        self._registered.append(ptr)

    @torch.no_grad()
    def run(self, unit: ParamUnit, params: list[torch.Tensor], grads: list[torch.Tensor | None], ready: object,
            clip_coef: float, lr_of: dict[int, float]) -> None:
        """Update ``params`` of ``unit`` from ``grads`` (device tensors; ``ready``: the event after the backward
        that produced them) and return once the results are back in host memory."""
        q = self.queues
        buffer, last_out = self._staging.get()
        done = last_out
        try:
            with q.on(self.compute):
                # a parameter the backward left without a gradient is updated with zeros, as the CPU path does
                kept = [g if g is not None else torch.zeros(p.shape, device=q.device)
                        for p, g in zip(params, grads, strict=True)]
            jobs, offset = [], 0
            for p, g in zip(params, kept, strict=True):
                states, scalars = self.optimizer.prepare_update(p, g, clip_coef, lr_of)
                host_copy = scalars.pop("copy")
                host = {"param": p.detach(), **states, **({"copy": host_copy} if host_copy is not None else {})}
                staged = {}
                for name, t in host.items():
                    staged[name] = buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
                    offset += _aligned(t.nbytes)
                jobs.append((host, staged, g, scalars))
            with q.on(self.copy_in):
                q.wait(last_out, self.copy_in)  # the buffer's previous unit has been copied out
                for host, staged, _, _ in jobs:
                    for name, t in host.items():
                        if name != "copy":  # written by the update, read by nobody before
                            staged[name].copy_(t, non_blocking=True)
                copied_in = q.record(self.copy_in)
            with q.on(self.compute):
                q.wait(copied_in, self.compute)
                q.wait(ready, self.compute)
                for _, staged, g, scalars in jobs:
                    state = {k: v for k, v in staged.items() if k not in ("param", "copy")}
                    reference_step(param=staged["param"], grad=g, state=state, copy=staged.get("copy"), **scalars)
                updated = q.record(self.compute)
            if self.compute is not None:
                for g in kept:
                    g.record_stream(self.compute)  # allocated on the training's compute stream, read on this one
            with q.on(self.copy_out):
                q.wait(updated, self.copy_out)
                for host, staged, _, _ in jobs:
                    for name, t in host.items():
                        t.copy_(staged[name], non_blocking=True)
                done = q.record(self.copy_out)
        finally:
            self._staging.put((buffer, done))
        host_wait(done, f"the device update of {unit.label}", self.timeout_s)

    def close(self) -> None:
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()
        while not self._staging.empty():
            self._staging.get_nowait()
