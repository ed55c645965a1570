"""Where kept layer boundaries wait for the backward: on the GPU, in pinned CPU memory, or in files on NVMe.

``put`` is called right after a boundary is produced on the compute stream; ``prefetch`` starts bringing it back
early in the backward; ``get`` hands the device tensor to the compute stream. Offloads run on the D2H queue, reloads
on the H2D queue, and NVMe file I/O on background threads; order is kept with events only, never a device sync.
Reloads have their own H2D stream (``DeviceQueues.reload``): on the weight stream a reload queued late (after an
NVMe read) would wait behind weight copies that wait for compute further ahead, and the compute would stall on it.
On the CPU every copy is synchronous, but the same code runs, files included, so CI tests the real path.
"""

from __future__ import annotations

import shutil
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from lightning_lazytrain.engine.activations.spill import SpillDir, SpillError
from lightning_lazytrain.engine.device import DeviceQueues, host_wait
from lightning_lazytrain.engine.weights.pinned import PinnedAllocator

__all__ = ["ActivationHomes", "MissingBoundaryError", "SpillError"]


class MissingBoundaryError(LookupError):
    """``get``/``prefetch`` of a boundary that was not ``put`` in this step."""


def _finalize(pool: ThreadPoolExecutor | None, root: str | None) -> None:
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


class _HostBuffers:
    """Host (pinned when on CUDA) byte buffers, pinned once per distinct size and reused across steps.

    A returned buffer carries the event of the last device copy that used it: a device-side user makes its stream
    wait on it, a host-side user (a file read) blocks on it.
    """

    def __init__(self, pinned: PinnedAllocator) -> None:
        self._pinned = pinned
        self._free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self._lock = threading.Lock()  # taken from the main thread and from the I/O threads
        self.allocated = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            self.allocated += 1
            return self._pinned.empty(nbytes, torch.uint8), None

    def give(self, buf: torch.Tensor, last_use: torch.cuda.Event | None) -> None:
        with self._lock:
            self._free.setdefault(buf.numel(), []).append((buf, last_use))


@dataclass
class _Entry:
    home: str
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    tensor: torch.Tensor | None = None  # "gpu": the boundary; "cpu"/"nvme" after prefetch: the reload target
    host: torch.Tensor | None = None  # "cpu": the host buffer holding the bytes
    offloaded: torch.cuda.Event | None = None  # D2H done
    ready: torch.cuda.Event | None = None  # "cpu": H2D done
    name: str | None = None  # "nvme": the spill file
    write: Future | None = None
    read: Future | None = None  # "nvme": resolves to the H2D event


class ActivationHomes:
    def __init__(self, queues: DeviceQueues, homes: Sequence[str], pinned: PinnedAllocator, spill_dir: str | None,
                 timeout_s: float = 600.0) -> None:
        self.queues, self.homes, self.timeout_s = queues, tuple(homes), timeout_s
        self.buffers = _HostBuffers(pinned)
        self.offload_bytes = self.reload_bytes = self.nvme_write_bytes = self.nvme_read_bytes = 0
        self._stats_lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._closed = False
        self.spill_dir, self.spill, self._pool = spill_dir, None, None
        if "nvme" in self.homes and spill_dir is None:
            raise ValueError("the plan puts boundaries on NVMe but no spill_dir was given: pass spill_dir (a folder "
                             "on a fast local disk) or a plan without NVMe homes (nvme budget 0)")
        if spill_dir is not None:
            self.spill = SpillDir(spill_dir)
            if "nvme" in self.homes:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lazytrain-spill")
        # Runs at close(), garbage collection or interpreter exit, whichever comes first; holds no ref to self.
        self._finalizer = weakref.finalize(self, _finalize, self._pool, self.spill.root if self.spill else None)

    def put(self, i: int, tensor: torch.Tensor) -> None:
        """Store boundary ``i`` (just produced on the compute stream) in its planned home."""
        if self._closed:
            raise RuntimeError("ActivationHomes.put after close()")
        home = self.homes[i]
        if home == "recompute":
            raise ValueError(f"boundary {i} is planned for recompute; it has no home to be put in")
        self._raise_write_errors()
        if i in self._entries:  # a forward re-run without a backward in between: the newer value wins
            self._drop(self._entries.pop(i))
        entry = _Entry(home, tensor.shape, tensor.dtype, tensor.numel() * tensor.element_size())
        if home == "gpu":
            entry.tensor = tensor
        else:
            self._offload(i, entry, tensor.detach())
        self._entries[i] = entry

    def _offload(self, i: int, entry: _Entry, tensor: torch.Tensor) -> None:
        q = self.queues
        tensor = tensor.contiguous()
        produced = q.record()
        buf, last_use = self.buffers.take(entry.nbytes)
        q.wait(produced, q.d2h)
        q.wait(last_use, q.d2h)  # a reused buffer may still feed a reload
        with q.on(q.d2h):
            buf.view(entry.dtype).view(entry.shape).copy_(tensor, non_blocking=True)
        entry.offloaded = q.record(q.d2h)
        if q.is_cuda:
            # The caller drops its reference soon; the caching allocator must not hand the block to new compute
            # work before the D2H that reads it has finished. record_stream defers reuse until then.
            tensor.record_stream(q.d2h)
        self._count("offload_bytes", entry.nbytes)
        if entry.home == "cpu":
            entry.host = buf
        else:
            entry.name = f"boundary-{i}.bin"
            entry.write = self._pool.submit(self._write, i, entry, buf)

    def _write(self, i: int, entry: _Entry, buf: torch.Tensor) -> None:
        last_use = entry.offloaded  # until the D2H into it is known done, the buffer may not be reused
        try:
            host_wait(entry.offloaded, f"the offload of boundary {i}", self.timeout_s)
            last_use = None
            self.spill.write(entry.name, memoryview(buf.numpy()).cast("B"), f"boundary {i}")
        finally:
            self.buffers.give(buf, last_use)
        self._count("nvme_write_bytes", entry.nbytes)

    def _raise_write_errors(self) -> None:
        for entry in self._entries.values():
            if entry.write is not None and entry.write.done() and entry.write.exception() is not None:
                raise entry.write.exception()

    def flush(self) -> None:
        """Wait for every pending NVMe write and raise the first failure (e.g. the end of a forward)."""
        for i, entry in list(self._entries.items()):
            if entry.write is not None:
                self._result(entry.write, i, "written to")

    def prefetch(self, i: int) -> None:
        """Start bringing boundary ``i`` back to the device, so it overlaps compute queued before ``get(i)``."""
        entry = self._entry(i)
        if entry.home == "gpu" or entry.tensor is not None or entry.read is not None:
            return
        q = self.queues
        # Allocated on the compute stream, so it belongs to the compute stream's pool and needs no record_stream;
        # the H2D waits for the compute work queued so far, which may still use the memory's previous owner.
        entry.tensor = torch.empty(entry.shape, dtype=entry.dtype, device=q.device)
        allocated = q.record()
        if entry.home == "cpu":
            q.wait(allocated, q.reload)
            q.wait(entry.offloaded, q.reload)
            with q.on(q.reload):
                entry.tensor.copy_(entry.host.view(entry.dtype).view(entry.shape), non_blocking=True)
            entry.ready = q.record(q.reload)
            self.buffers.give(entry.host, entry.ready)
            entry.host = None
            self._count("reload_bytes", entry.nbytes)
        else:
            entry.read = self._pool.submit(self._read, i, entry, allocated)

    def _read(self, i: int, entry: _Entry, allocated: torch.cuda.Event | None) -> torch.cuda.Event | None:
        self._result(entry.write, i, "written to")  # same pool, submitted earlier: never waits on a queued task
        q = self.queues
        buf, last_use = self.buffers.take(entry.nbytes)
        host_wait(last_use, "a reload out of a reused host buffer", self.timeout_s)
        try:
            self.spill.read(entry.name, memoryview(buf.numpy()).cast("B"), f"boundary {i}")
        except BaseException:
            self.buffers.give(buf, None)
            raise
        self._count("nvme_read_bytes", entry.nbytes)
        # The H2D is queued from this thread, so it starts as soon as the bytes are in, not at get().
        q.wait(allocated, q.reload)
        with q.on(q.reload):
            entry.tensor.copy_(buf.view(entry.dtype).view(entry.shape), non_blocking=True)
        ready = q.record(q.reload)
        self.buffers.give(buf, ready)
        self._count("reload_bytes", entry.nbytes)
        return ready

    def get(self, i: int) -> torch.Tensor:
        """The device tensor of boundary ``i``, ordered after its reload on the compute stream; consumed once."""
        self.prefetch(i)
        entry = self._entries[i]
        if entry.read is not None:
            entry.ready = self._result(entry.read, i, "read back from")
        del self._entries[i]  # only once it arrived: on an error, clear() still finds it and cleans up
        self.queues.wait(entry.ready)
        return entry.tensor

    def clear(self) -> None:
        """Drop every boundary of this step (after a backward, a no-grad forward, or a failed step)."""
        entries, self._entries = self._entries, {}
        for entry in entries.values():
            self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        # A queued read is cancelled; a write is not (it holds a host buffer that it gives back when it ends).
        if entry.read is not None and not entry.read.cancel():
            entry.ready = self._result(entry.read, -1, quiet=True)
        if entry.write is not None:
            self._result(entry.write, -1, quiet=True)
        # A reload target freed before its H2D finished could be handed to new compute work while still written.
        self.queues.wait(entry.ready)
        if entry.host is not None:
            self.buffers.give(entry.host, entry.offloaded)
        if entry.name is not None:
            self.spill.remove(entry.name)

    def close(self) -> None:
        """Clear, stop the I/O threads and delete the spill folder. Idempotent."""
        if self._closed:
            return
        try:
            self.clear()
        finally:
            self._closed = True
            self._finalizer()

    def take_stats(self) -> dict[str, int]:
        """The byte counters since the previous call (one step when called once per step), then reset them."""
        with self._stats_lock:
            out = self.stats()
            self.offload_bytes = self.reload_bytes = self.nvme_write_bytes = self.nvme_read_bytes = 0
        return out

    def stats(self) -> dict[str, int]:
        return {"offload_bytes": self.offload_bytes, "reload_bytes": self.reload_bytes,
                "nvme_write_bytes": self.nvme_write_bytes, "nvme_read_bytes": self.nvme_read_bytes,
                "host_buffers": self.buffers.allocated}

    def _entry(self, i: int) -> _Entry:
        if i not in self._entries:
            raise MissingBoundaryError(f"boundary {i} was never put in this step (its planned home is "
                                       f"{self.homes[i] if 0 <= i < len(self.homes) else 'out of range'}), or was "
                                       "already consumed by get()")
        return self._entries[i]

    def _result(self, future: Future, i: int, what: str = "", quiet: bool = False):
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            if quiet:
                return None
            raise TimeoutError(f"lazytrain waited {self.timeout_s:.0f} s for boundary {i} to be {what} the spill "
                               f"dir {self.spill_dir!r}; is the disk stalled or full?") from None
        except Exception:
            if quiet:  # a dropped boundary's failure no longer matters
                return None
            raise

    def _count(self, name: str, nbytes: int) -> None:
        with self._stats_lock:
            setattr(self, name, getattr(self, name) + nbytes)
