"""The streams and events of the executor, with the same interface on the CPU (where they are no-ops).

On CUDA there are four queues: the compute stream (whatever stream is current when a layer runs: autograd
replays the backward on the stream the forward used), a weight H2D stream, a D2H stream (gradients, activation
offloads) and an activation-reload H2D stream. Work is
ordered only by events; nothing here synchronizes the device. On the CPU every copy is synchronous, so an
event is ``None`` and waiting on it does nothing: the control flow stays identical and testable without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)


def prefer_expandable_segments() -> bool:
    """Ask CUDA's caching allocator for expandable segments, unless the user configured the allocator or it has
    already started (it reads the setting once). Returns whether it was set.

    Near a memory cap the streamed layers' varying working sets fragment fixed segments: Qwen2.5-7B at batch 16
    under a 24 GiB cap, and at batch 64 on an 80 GB H100, ran out of memory without it and ran with it
    (docs/benchmarks_history.md).
    """
    if {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ):
        return False
    if torch.cuda.is_initialized():
        log.warning("lazytrain: CUDA started before the strategy was made, so its allocator runs without expandable"
                    " segments and a step near the memory limit can fail from fragmentation; set"
                    " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before anything uses the GPU")
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    log.info("lazytrain: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set PYTORCH_CUDA_ALLOC_CONF to choose)")
    return True


class DeviceQueues:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
            self.reload = torch.cuda.Stream(device)
        else:
            self.h2d = self.d2h = self.reload = None
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._stall_carry = 0.0
        self._busy: list[tuple[torch.cuda.Event, torch.cuda.Event] | None] = []  # None ends a span

    def compute_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    def record(self, stream: torch.cuda.Stream | None = None, timing: bool = False) -> torch.cuda.Event | None:
        """An event marking everything queued so far on ``stream`` (default: the compute stream)."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream or self.compute_stream())
        return event

    def wait(self, event: torch.cuda.Event | None, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the compute stream) wait for ``event`` without blocking the host.

        A wait of the compute stream is bracketed by timing events: the gap between them is the stall, the time
        the GPU's compute sat idle waiting for a transfer.
        """
        if event is None:
            return
        if stream is not None:
            stream.wait_event(event)
            return
        compute = self.compute_stream()
        before = torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(event)
        after = torch.cuda.Event(enable_timing=True)
        after.record(compute)
        self._stalls.append((before, after))
        if len(self._stalls) > 4096:  # a long no-grad loop with nobody reading the stall: fold what is done
            self._stall_carry += self.take_stall_seconds()

    def take_stall_seconds(self) -> float:
        """Seconds of compute-stream stall in the waits that completed since the last call (no device sync)."""
        done = [pair for pair in self._stalls if pair[1].query()]
        self._stalls = [pair for pair in self._stalls if not pair[1].query()]
        carry, self._stall_carry = self._stall_carry, 0.0
        return carry + sum(a.elapsed_time(b) for a, b in done) / 1e3

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Bracket compute-stream work (one layer's kernels) with timing events; a no-op off CUDA."""
        if not self.is_cuda:
            yield
            return
        start = self.record(timing=True)
        try:
            yield
        finally:
            self._busy.append((start, self.record(timing=True)))

    def end_span(self) -> None:
        """Close the current span of bracketed work (the stack's forward, or its backward): the time between spans
        (embedding, head and loss) is neither busy nor idle here."""
        if self.is_cuda and self._busy and self._busy[-1] is not None:
            self._busy.append(None)

    def take_busy_idle_seconds(self) -> tuple[float, float] | None:
        """(busy, idle) seconds of the compute stream over the closed spans that completed since the last call:
        busy is the sum of the brackets, idle the rest of each span from its first start to its last end (waits
        for transfers, for the host to launch the next layer, for updates). None off CUDA."""
        if not self.is_cuda:
            return None
        busy = idle = 0.0
        while None in self._busy and self._busy[self._busy.index(None) - 1][1].query():
            cut = self._busy.index(None)
            span, self._busy = self._busy[:cut], self._busy[cut + 1 :]
            b, i = busy_idle_seconds(span)
            busy, idle = busy + b, idle + i
        return busy, idle

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield


def busy_idle_seconds(pairs: list) -> tuple[float, float]:
    """(busy, idle) seconds from ordered (start, end) timing-event pairs of one stream (``elapsed_time`` in ms)."""
    if not pairs:
        return 0.0, 0.0
    busy = sum(a.elapsed_time(b) for a, b in pairs) / 1e3
    span = pairs[0][0].elapsed_time(pairs[-1][1]) / 1e3
    return busy, max(0.0, span - busy)


def host_wait(event: torch.cuda.Event | None, what: str, timeout_s: float) -> None:
    """Block the calling host thread until ``event`` completed, or raise naming what was waited for.

    A plain ``event.synchronize()`` can hang forever when a transfer never finishes; polling with a deadline turns
    that into an error a user can act on.
    """
    if event is None or event.query():
        return
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"lazytrain waited {timeout_s:.0f} s for {what} to finish on the GPU; giving up.")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def device_free_bytes(device: torch.device) -> int:
    """Free device memory as this process may use it: a ``set_per_process_memory_fraction`` cap (a smaller GPU
    emulated, or a share left to another process) bounds it below what the driver reports free."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    return int(max(0, min(free, fraction * total - torch.cuda.memory_reserved(device))))
