"""Some units' optimizer updates on the GPU, beside the CPU's (``planning/update_placement.py`` says which),
pipelined over units.

A device unit's gradients stay on the device after the backward (no D2H). Its update runs the same math as the CPU
kernel (``optim.reference.reference_step``, from ``HybridAdamW.prepare_update``'s scalars) on device copies of the
fp32 masters and optimizer states, and moves what the next forward streams out to the host tensors, so checkpoints,
resume and callbacks see nothing different. Where the copies live between steps:

- staged: two staging buffers, refilled for every update. Each phase has its own stream: copies in (H2D), the
  update, copies out (D2H). A staging buffer is handed on with the event of its last copy out, which the next
  unit's copies in wait for on the device, so while unit ``k`` is updated, unit ``k + 1`` is copied in and unit
  ``k - 1`` copied out.
- resident: each unit keeps its own device copy of masters and states, copied in once (and again when the host
  tensors were replaced or rewritten: a resume, a load). An update then moves nothing in, and only the stream copy,
  which the next forward reads from host memory, goes out: 2 bytes a parameter instead of 14. The masters and
  states on the device are the current ones; ``drain`` writes them back to the host tensors, and every reader of
  host state goes through it first (the strategy's checkpoint save and state dicts, a load, teardown), so the D2H
  stream carries nothing ahead of the stream copies the next forward waits for.

Everything a device update does is stream work the host only queues, so ``launch`` runs on the main thread at the
optimizer step and returns at once; the unit's ``WeightVersions`` hold is a ``CopiedOut``, done when the copy the
next forward streams is back in host memory. An earlier version ran each unit's launch on one of two worker
threads that then waited for its copy out. Their Python held the GIL the main thread needed to queue the next
forward, so it cost the main thread about its own length anyway
(``benchmarks/results/archive/gil_convoy_706f352_cpu2.json``:
equal for threads and inline), while the step's stats did not show it; now it is the main thread's
``device_update_launch_s``. Each unit's views into its device buffer are built once and kept while the host tensors
they mirror stay the same, which leaves per parameter ``prepare_update`` and the kernel launch.

The update itself is ``optim.triton_adamw.fused_step`` on CUDA where Triton is installed (one kernel per
parameter), else ``optim.reference.reference_step``: the same math.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightning_lazytrain.engine.device import DeviceQueues, host_wait
from lightning_lazytrain.engine.updates.device_kernel import update_kernel
from lightning_lazytrain.engine.weights.layout import ParamUnit

log = logging.getLogger(__name__)

IN_FLIGHT = 2  # staging buffers: one unit copied in while the one before is updated
_ALIGN = 256  # bytes: every staged tensor starts on a fresh DMA-friendly boundary


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def staging_bytes(unit: ParamUnit, optimizer: torch.optim.Optimizer) -> int:
    """Device bytes one staging buffer needs for ``unit``: each parameter's master, state tensors and stream copy."""
    total = 0
    for e in unit.trained:  # a frozen parameter has no update to move
        states = optimizer.state_tensors(e.param)
        total += _aligned(e.numel * e.param.element_size()) + sum(_aligned(t.nbytes) for t in states)
        total += _aligned(e.numel * 2)  # a bf16 stream copy (counted whether or not one is registered)
    return total


class CopiedOut:
    """A device unit's pending update as ``WeightVersions`` holds it: done once the copy the next forward streams
    (staged: everything) is in host memory (``event``; None: nothing is left in flight, as on the CPU)."""

    def __init__(self, event: object, what: str, timeout_s: float) -> None:
        self.event, self.what, self.timeout_s = event, what, timeout_s

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def result(self, timeout: float | None = None) -> None:
        # the engine's own limit holds even where the reader allows longer, as a worker's host wait did
        host_wait(self.event, self.what, self.timeout_s if timeout is None else min(timeout, self.timeout_s))


@dataclass
class _ParamViews:
    """One parameter's host tensors and their places in its unit's device buffer, fixed while the host tensors are
    the same objects."""

    param: torch.Tensor  # the master the optimizer knows
    host: dict[str, torch.Tensor]  # "param" (the master, detached), its states by name, "copy" (the stream copy)
    staged: dict[str, torch.Tensor]  # the same names, viewing the device buffer
    state: dict[str, torch.Tensor]  # the staged states alone, as the kernel takes them
    streamed: str  # the name of what the next forward streams: "copy", or "param" where there is no copy
    kernel: Callable[..., None]
    written_back: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False)  # resident: (host, device) at drain

    def __post_init__(self) -> None:
        self.written_back = [(t, self.staged[name]) for name, t in self.host.items() if name != self.streamed]

    def mirrors(self, param: torch.Tensor, states: dict[str, torch.Tensor], copy: torch.Tensor | None) -> bool:
        host = self.host
        return (param is self.param and copy is host.get("copy") and len(states) == len(self.state)
                and all(host.get(name) is t for name, t in states.items()))


class DeviceUpdateQueue:
    """Queues the updates of ``units`` (those assigned to the device) from the main thread; ``resident``: masters
    and states stay on the device between steps (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: list[ParamUnit], queues: DeviceQueues,
                 timeout_s: float, resident: bool = False) -> None:
        self.optimizer, self.queues, self.timeout_s = optimizer, queues, timeout_s
        self.units, self.resident = units, resident
        cuda = queues.is_cuda
        self.copy_in, self.compute, self.copy_out = ((torch.cuda.Stream(queues.device) for _ in range(3)) if cuda
                                                     else (None, None, None))
        self._registered: dict[int, torch.Tensor] = {}  # page-locked address -> its tensor, kept alive until unpinned
        self._staging: collections.deque = collections.deque()  # (buffer, event of its last copy out)
        self._homes: dict[int, torch.Tensor] = {}
        self._views: dict[tuple[int, int], list[_ParamViews]] = {}  # (unit index, buffer address) -> its views
        self._last_out: dict[int, object] = {}  # resident: each home's latest copies out
        self._dirty: dict[int, tuple[list[_ParamViews], object]] = {}  # resident: views newer on the device, event
        self._mirrored: set[int] = set()  # resident: homes copied in from the host tensors their views hold
        self.copies_in = 0  # units whose masters and states were copied in (resident: once each, and after loads)
        if resident:
            for unit in units:
                self._homes[unit.index] = torch.empty(staging_bytes(unit, optimizer), dtype=torch.uint8,
                                                      device=queues.device)
        else:
            nbytes = max((staging_bytes(u, optimizer) for u in units), default=0)
            for _ in range(IN_FLIGHT):
                self._staging.append((torch.empty(nbytes, dtype=torch.uint8, device=queues.device), None))
        self._pin_host_tensors()

    @property
    def held_bytes(self) -> int:
        """Device bytes held for the run: the resident homes, or the staging buffers."""
        return sum(h.numel() for h in self._homes.values()) + sum(b.numel() for b, _ in self._staging)

    def _host_tensors(self) -> list[torch.Tensor]:
        return [t for u in self.units for t in (u.master, *(s for e in u.unique
                                                             for s in self.optimizer.state_tensors(e.param)))]

    def _pin_host_tensors(self) -> None:
        """Page-lock the masters and states the updates copy, and unpin those a load replaced (each registration
        holds its tensor, so none is freed while still registered)."""
        tensors = self._host_tensors()
        current = {t.data_ptr() for t in tensors}
        for ptr in [p for p in self._registered if p not in current]:
            torch.cuda.cudart().cudaHostUnregister(ptr)
            del self._registered[ptr]
        for t in tensors:
            self._pin(t)

    def _pin(self, t: torch.Tensor) -> None:
        """Page-lock ``t`` in place (cudaHostRegister), so the copies in and out are asynchronous DMA."""
        if not self.queues.is_cuda or t.is_pinned() or t.numel() == 0:
            return
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            log.warning("lazytrain: could not pin %d bytes for device updates (CUDA error %s); those copies will be"
                        " synchronous", nbytes, int(err))
            return
        self._registered[ptr] = t

    def _take_buffer(self, unit: ParamUnit) -> tuple[torch.Tensor, object]:
        if self.resident:
            return self._homes[unit.index], self._last_out.get(unit.index)
        return self._staging.popleft()  # two buffers, each given back as soon as its unit is queued

    def _give_back(self, unit: ParamUnit, buffer: torch.Tensor, done: object) -> None:
        if self.resident:
            self._last_out[unit.index] = done
        else:
            self._staging.append((buffer, done))

    @torch.no_grad()
    def launch(self, unit: ParamUnit, params: list[torch.Tensor], grads: list[torch.Tensor | None], ready: object,
               clip_coef: float, lr_of: dict[int, float]) -> CopiedOut:
        """Queue the update of ``params`` of ``unit`` from ``grads`` (device tensors; ``ready``: the event after the
        backward that produced them) and its copies out; returns without waiting for any of it."""
        q = self.queues
        buffer, last_out = self._take_buffer(unit)
        done = last_out
        try:
            with q.on(self.compute):
                # a parameter the backward left without a gradient is updated with zeros, as the CPU path does
                kept = [g if g is not None else torch.zeros(p.shape, device=q.device)
                        for p, g in zip(params, grads, strict=True)]
            prepared = [self.optimizer.prepare_update(p, g, clip_coef, lr_of) for p, g in zip(params, kept)]
            views = self._views_of(unit, buffer, params, prepared)
            copied_in = self._copy_in(unit, views, last_out)
            with q.on(self.compute):
                q.wait(copied_in, self.compute)
                q.wait(last_out, self.compute)  # resident: the previous copies out still read this home
                q.wait(ready, self.compute)
                for v, g, (_, scalars) in zip(views, kept, prepared, strict=True):
                    v.kernel(param=v.staged["param"], grad=g, state=v.state, copy=v.staged.get("copy"),
                             **{k: x for k, x in scalars.items() if k != "copy"})
                updated = q.record(self.compute)
            if self.compute is not None:
                for g in kept:
                    g.record_stream(self.compute)  # allocated on the training's compute stream, read on this one
            done = self._copy_out(unit, views, updated)
        finally:
            self._give_back(unit, buffer, done)
        return CopiedOut(done, f"the device update of {unit.label}", self.timeout_s)

    def _views_of(self, unit: ParamUnit, buffer: torch.Tensor, params: list[torch.Tensor],
                  prepared: list[tuple[dict, dict]]) -> list[_ParamViews]:
        """The views of ``params`` into ``buffer``: kept from an earlier update while the host tensors are the same
        objects, else built again (and a resident home is then copied in again)."""
        key = (unit.index, buffer.data_ptr())
        kept = self._views.get(key)
        if kept is not None and len(kept) == len(params) and all(
                v.mirrors(p, states, scalars["copy"]) for v, p, (states, scalars) in zip(kept, params, prepared)):
            return kept
        views, offset = [], 0
        for p, (states, scalars) in zip(params, prepared, strict=True):
            copy = scalars["copy"]
            host = {"param": p.detach(), **states, **({"copy": copy} if copy is not None else {})}
            staged = {}
            for name, t in host.items():
                staged[name] = buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
                offset += _aligned(t.nbytes)
            state = {k: staged[k] for k in states}
            views.append(_ParamViews(p, host, staged, state, "copy" if copy is not None else "param",
                                     update_kernel(staged["param"], state, scalars["block"])))
        self._views[key] = views
        self._mirrored.discard(unit.index)
        return views

    def _copy_in(self, unit: ParamUnit, views: list[_ParamViews], last_out: object) -> object:
        """Copy masters and states in (staged: always; resident: when the home does not mirror the host tensors)."""
        q = self.queues
        if self.resident and unit.index in self._mirrored:
            return None
        with q.on(self.copy_in):
            q.wait(last_out, self.copy_in)  # the buffer's previous unit has been copied out
            for v in views:
                for name, t in v.host.items():
                    if name != "copy":  # written by the update, read by nobody before
                        v.staged[name].copy_(t, non_blocking=True)
            copied_in = q.record(self.copy_in)
        if self.resident:
            self._mirrored.add(unit.index)
        self.copies_in += 1
        return copied_in

    def _copy_out(self, unit: ParamUnit, views: list[_ParamViews], updated: object) -> object:
        """Copy out what the next forward streams (staged: everything); the event after those copies."""
        q = self.queues
        with q.on(self.copy_out):
            q.wait(updated, self.copy_out)
            for v in views:
                for name, t in v.host.items():
                    if not self.resident or name == v.streamed:
                        t.copy_(v.staged[name], non_blocking=True)
            done = q.record(self.copy_out)
        if self.resident:
            self._dirty[unit.index] = (views, updated)
        return done

    def host_state_changed(self) -> None:
        """A load rewrote the host masters or replaced the states (the strategy drained before it, so the device
        held nothing newer): page-lock the new tensors and copy every resident home in again before its next
        update."""
        self._wait_copies_out()
        self._dirty.clear()
        self._pin_host_tensors()
        self._mirrored.clear()

    def drain(self) -> None:
        """Write every resident unit's masters and states back to the host tensors and wait until they are there."""
        q = self.queues
        with q.on(self.copy_out):
            for index, (views, updated) in self._dirty.items():
                q.wait(updated, self.copy_out)
                for host, device in (pair for v in views for pair in v.written_back):
                    host.copy_(device, non_blocking=True)
                self._last_out[index] = q.record(self.copy_out)
        self._dirty.clear()
        self._wait_copies_out()

    def _wait_copies_out(self) -> None:
        for index, event in list(self._last_out.items()):
            host_wait(event, f"the copy of unit {index}'s weights to the host", self.timeout_s)

    def close(self) -> None:
        self.drain()
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()
        self._staging.clear()
        self._homes.clear()
        self._views.clear()
