"""Some units' optimizer updates on the GPU, beside the CPU's (``placement.py`` says which), pipelined over units.

A device unit's gradients stay on the device after the backward (no D2H). Its update runs the same math as the CPU
kernel (``optim.reference.reference_step``, from ``HybridAdamW.prepare_update``'s scalars) on device copies of the
fp32 masters and optimizer states, and moves masters, states and the bf16 stream copy out, so the host tensors stay
current and checkpoints, resume and callbacks see nothing different. Where the copies live between steps:

- staged: two staging buffers, refilled for every update. Each phase has its own stream: copies in (H2D), the
  update, copies out (D2H). Two units are in flight, launched by the two threads of the device worker pool: while
  unit ``k`` is updated, unit ``k + 1`` is copied in and unit ``k - 1`` copied out. A staging buffer is handed on
  with the event of its last copy out, which the next unit's copies in wait for on the device.
- resident: each unit keeps its own device copy of masters and states, copied in once (and again when the host
  tensors were replaced or rewritten: a resume, a load). An update then moves nothing in, and only the stream copy,
  which the next forward reads from host memory, goes out: 2 bytes a parameter instead of 14. The masters and
  states on the device are the current ones; ``drain`` writes them back to the host tensors, and every reader of
  host state goes through it first (the strategy's checkpoint save and state dicts, a load, teardown). Writing them
  back after every update, as an earlier version did, queued 6 more bytes a parameter on the D2H stream ahead of the
  next unit's stream copy, which the next forward waits for.

The update itself is ``optim.triton_adamw.fused_step`` on CUDA where Triton is installed (one kernel per
parameter), else ``optim.reference.reference_step``: the same math.

A unit's job returns, and its ``WeightVersions`` hold ends, only once the copy the next forward streams is back in
host memory, so no reader sees half-written weights.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from functools import cache

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


@cache
def _triton_kernels():
    try:
        from lightning_lazytrain.optim import triton_adamw
    except ImportError:  # no Triton (a CPU build of torch): the torch reference runs the update
        return None
    return triton_adamw


def update_kernel(param: torch.Tensor, state: dict, block: int) -> Callable[..., None]:
    """The function that runs one parameter's update: the fused Triton kernel where it applies, else the torch
    reference (same arguments, same math)."""
    kernels = _triton_kernels() if param.device.type == "cuda" else None
    return kernels.fused_step if kernels is not None and kernels.supports(param, state, block) else reference_step


def _streamed(host: dict[str, torch.Tensor]) -> str:
    """Which of a parameter's tensors the next forward streams: its bf16 copy, or the master itself."""
    return "copy" if "copy" in host else "param"


class DeviceUpdatePath:
    """Runs the updates of ``units`` (those assigned to the device), called from ``IN_FLIGHT`` worker threads;
    ``resident``: masters and states stay on the device between steps (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: list[ParamUnit], queues: DeviceQueues,
                 timeout_s: float, resident: bool = False) -> None:
        self.optimizer, self.queues, self.timeout_s = optimizer, queues, timeout_s
        self.units, self.resident = units, resident
        cuda = queues.is_cuda
        self.copy_in, self.compute, self.copy_out = ((torch.cuda.Stream(queues.device) for _ in range(3)) if cuda
                                                     else (None, None, None))
        self._registered: dict[int, torch.Tensor] = {}  # page-locked address -> its tensor, kept alive until unpinned
        self._staging: queue.Queue = queue.Queue()
        self._homes: dict[int, torch.Tensor] = {}
        self._last_out: dict[int, object] = {}  # resident: each home's latest copies out
        self._dirty: dict[int, tuple[list, object]] = {}  # resident: (host, device) pairs newer on the device, event
        self._sources: dict[int, tuple[int, ...]] = {}  # resident: the host tensors each home was copied from
        self.copies_in = 0  # units whose masters and states were copied in (resident: once each, and after loads)
        self._count_lock = threading.Lock()  # two worker threads count
        if resident:
            for unit in units:
                self._homes[unit.index] = torch.empty(staging_bytes(unit, optimizer), dtype=torch.uint8,
                                                      device=queues.device)
        else:
            nbytes = max((staging_bytes(u, optimizer) for u in units), default=0)
            for _ in range(IN_FLIGHT):
                self._staging.put((torch.empty(nbytes, dtype=torch.uint8, device=queues.device), None))
        self._pin_host_tensors()

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
        return self._staging.get()

    def _give_back(self, unit: ParamUnit, buffer: torch.Tensor, done: object) -> None:
        if self.resident:
            self._last_out[unit.index] = done
        else:
            self._staging.put((buffer, done))

    @torch.no_grad()
    def run(self, unit: ParamUnit, params: list[torch.Tensor], grads: list[torch.Tensor | None], ready: object,
            clip_coef: float, lr_of: dict[int, float]) -> None:
        """Update ``params`` of ``unit`` from ``grads`` (device tensors; ``ready``: the event after the backward
        that produced them) and return once the stream copy (staged: everything) is back in host memory."""
        q = self.queues
        buffer, last_out = self._take_buffer(unit)
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
            copied_in = self._copy_in(unit, jobs, last_out)
            with q.on(self.compute):
                q.wait(copied_in, self.compute)
                q.wait(last_out, self.compute)  # resident: the previous copies out still read this home
                q.wait(ready, self.compute)
                for _, staged, g, scalars in jobs:
                    state = {k: v for k, v in staged.items() if k not in ("param", "copy")}
                    step = update_kernel(staged["param"], state, scalars["block"])
                    step(param=staged["param"], grad=g, state=state, copy=staged.get("copy"), **scalars)
                updated = q.record(self.compute)
            if self.compute is not None:
                for g in kept:
                    g.record_stream(self.compute)  # allocated on the training's compute stream, read on this one
            done = self._copy_out(unit, jobs, updated)
        finally:
            self._give_back(unit, buffer, done)
        host_wait(done, f"the device update of {unit.label}", self.timeout_s)

    def _copy_in(self, unit: ParamUnit, jobs: list, last_out: object) -> object:
        """Copy masters and states in (staged: always; resident: when the home is not from these host tensors)."""
        q = self.queues
        sources = tuple(t.data_ptr() for host, _, _, _ in jobs for name, t in host.items() if name != "copy")
        if self.resident and self._sources.get(unit.index) == sources:
            return None
        with q.on(self.copy_in):
            q.wait(last_out, self.copy_in)  # the buffer's previous unit has been copied out
            for host, staged, _, _ in jobs:
                for name, t in host.items():
                    if name != "copy":  # written by the update, read by nobody before
                        staged[name].copy_(t, non_blocking=True)
            copied_in = q.record(self.copy_in)
        if self.resident:
            self._sources[unit.index] = sources
        with self._count_lock:
            self.copies_in += 1
        return copied_in

    def _copy_out(self, unit: ParamUnit, jobs: list, updated: object) -> object:
        """Copy out what the next forward streams (staged: everything); the event after those copies."""
        q = self.queues
        with q.on(self.copy_out):
            q.wait(updated, self.copy_out)
            for host, staged, _, _ in jobs:
                for name, t in host.items():
                    if not self.resident or name == _streamed(host):
                        t.copy_(staged[name], non_blocking=True)
            done = q.record(self.copy_out)
        if self.resident:
            self._dirty[unit.index] = ([(t, staged[name]) for host, staged, _, _ in jobs for name, t in host.items()
                                        if name != _streamed(host)], updated)
        return done

    def host_state_changed(self) -> None:
        """A load rewrote the host masters or replaced the states (the strategy drained before it, so the device
        held nothing newer): page-lock the new tensors and copy every resident home in again before its next
        update."""
        self._wait_copies_out()
        self._dirty.clear()
        self._pin_host_tensors()
        self._sources.clear()

    def drain(self) -> None:
        """Write every resident unit's masters and states back to the host tensors and wait until they are there
        (called once no update is in flight)."""
        q = self.queues
        with q.on(self.copy_out):
            for index, (pairs, updated) in self._dirty.items():
                q.wait(updated, self.copy_out)
                for host, device in pairs:
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
        while not self._staging.empty():
            self._staging.get_nowait()
        self._homes.clear()
