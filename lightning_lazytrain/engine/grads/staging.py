"""The staging buffers of the ``"device"`` and ``"nvme"`` gradient homes (``homes.py``) and the NVMe file.

A few pinned host buffers (``STAGING_BUFFERS``), each the size of the largest layer (``homes.staging_numel``), go
round between one I/O thread and the update worker. At the optimizer step the update queue asks for each unit's
pieces in update order (``fetch``); the I/O thread takes a free buffer (waiting for the worker to hand one back),
fills it (device home: a copy on the D2H stream from the gradients the backward left on the device; NVMe home: a
read of the unit's range of the file) and hands the buffer and the copy's event to the worker, which updates from
it and gives it back (``release``). So the host holds two buffers of gradients whatever the model's size, and the
next piece is staged while one is updated.

NVMe home: in the backward each piece is copied into a free buffer on the D2H stream and written by the I/O thread
to the unit's place in one file, reserved whole at setup (``posix_fallocate``: a disk too small fails there, not
half-way through a step), in ``spill_dir/lazytrain-<pid>-<random>`` (``activations/spill.SpillDir``: removed at
teardown, and by the next start after a crash).
"""

from __future__ import annotations

import os
import queue
import shutil
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lightning_lazytrain import faults
from lightning_lazytrain.engine.activations.spill import SpillDir
from lightning_lazytrain.engine.device import DeviceQueues, host_wait
from lightning_lazytrain.engine.grads.homes import STAGING_BUFFERS, piece_span
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.engine.weights.pinned import PinnedAllocator

Staged = tuple[torch.Tensor, object]  # a staging buffer's filled prefix and the event of the copy into it


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


class GradStaging:
    def __init__(
        self,
        queues: DeviceQueues,
        pinned: PinnedAllocator,
        numel: int,
        dtype: torch.dtype,
        timeout_s: float,
        spill_dir: str | None = None,
        spilled: list[ParamUnit] | None = None,
    ) -> None:
        self.queues, self.dtype, self.timeout_s, self.capacity = queues, dtype, timeout_s, numel
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(STAGING_BUFFERS):
            self._free.put(pinned.empty(numel, dtype))
        self.held_bytes = STAGING_BUFFERS * numel * dtype.itemsize
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-grad-io")
        self._file_offset: dict[int, int] = {}  # unit index -> its first element in the NVMe file
        self.spill, self._fd, self.file_bytes = None, -1, 0
        if spilled:
            self._open_file(spill_dir, spilled)

    def _open_file(self, spill_dir: str | None, units: list[ParamUnit]) -> None:
        if spill_dir is None:
            raise ValueError("gradient_home='nvme' needs a spill_dir (a folder on a fast local disk) for the gradients")
        total = 0
        for unit in units:
            self._file_offset[unit.index] = total
            total += unit.trainable_numel
        self.spill = SpillDir(spill_dir)
        path = self.spill.path("gradients")
        nbytes = self.file_bytes = total * self.dtype.itemsize
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.posix_fallocate(self._fd, 0, max(1, nbytes))
        except OSError as exc:
            self.close()
            raise faults.spill_write_failed(spill_dir, self.spill.root, "the gradient file", nbytes, exc) from exc

    def _take_buffer(self, what: str) -> torch.Tensor:
        try:
            return self._free.get(timeout=self.timeout_s)
        except queue.Empty as exc:
            raise TimeoutError(
                f"lazytrain waited {self.timeout_s:.0f} s for a gradient staging buffer for {what};"
                " the update worker is stuck"
            ) from exc

    def release(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)

    # NVMe home: in the backward
    def spill_piece(self, unit: ParamUnit, piece: list[int], grads: list[torch.Tensor | None]) -> Future:
        """Copy ``piece`` of ``unit``'s gradients (``grads`` aligned with ``unit.unique``) off the device and write
        it to the file; the future ends once it is written."""
        start, _ = piece_span(unit, piece)
        buffer = self._take_buffer(f"the gradients of {unit.label}")
        filled = self._fill_from_device(buffer, unit, piece, grads)
        offset = (self._file_offset[unit.index] + start) * self.dtype.itemsize
        return self._io.submit(self._write, filled, buffer, offset, unit.label)

    def _write(self, filled: Staged, buffer: torch.Tensor, offset: int, label: str) -> None:
        data, event = filled
        try:
            host_wait(event, f"the gradient copy of {label}", self.timeout_s)
            view = _bytes(data)
            try:
                while len(view):
                    n = os.pwrite(self._fd, view, offset)
                    view, offset = view[n:], offset + n
            except OSError as exc:
                raise faults.spill_write_failed(
                    self.spill.spill_dir,
                    self.spill.root,
                    f"the gradients of {label}",
                    data.numel() * data.element_size(),
                    exc,
                ) from exc
        finally:
            self.release(buffer)

    # both staged homes: at the update
    def fetch(
        self,
        unit: ParamUnit,
        piece: list[int],
        kept: list[torch.Tensor | None] | None,
        ready: object,
        written: Future | None,
    ) -> Future:
        """Stage ``piece`` of ``unit``'s gradients for its update: from ``kept`` (the device home's gradients, done
        at ``ready``) or from the file once ``written``. The future gives the filled buffer and its copy's event."""
        return self._io.submit(self._fetch, unit, piece, kept, ready, written)

    def _fetch(
        self,
        unit: ParamUnit,
        piece: list[int],
        kept: list[torch.Tensor | None] | None,
        ready: object,
        written: Future | None,
    ) -> tuple[torch.Tensor, Staged]:
        buffer = self._take_buffer(f"the update of {unit.label}")
        try:
            if kept is not None:
                self.queues.wait(ready, self.queues.d2h)
                return buffer, self._fill_from_device(buffer, unit, piece, kept)
            assert written is not None
            written.result(timeout=self.timeout_s)
            start, count = piece_span(unit, piece)
            data = buffer[:count]
            self._read(data, (self._file_offset[unit.index] + start) * self.dtype.itemsize, unit.label)
            return buffer, (data, None)
        except BaseException:
            self.release(buffer)
            raise

    def _read(self, data: torch.Tensor, offset: int, label: str) -> None:
        view = _bytes(data)
        try:
            while len(view):
                n = os.preadv(self._fd, [view], offset)
                if n == 0:
                    raise OSError(5, "the gradient file is shorter than written (truncated?)")
                view, offset = view[n:], offset + n
        except OSError as exc:
            raise faults.spill_read_failed(
                self.spill.spill_dir,
                self.spill.root,
                f"the gradients of {label}",
                data.numel() * data.element_size(),
                exc,
            ) from exc

    def _fill_from_device(
        self, buffer: torch.Tensor, unit: ParamUnit, piece: list[int], grads: list[torch.Tensor | None]
    ) -> Staged:
        """Copy ``piece``'s gradients into ``buffer`` on the D2H stream; the device tensors may be freed once the
        stream has passed the copy."""
        start, count = piece_span(unit, piece)
        with self.queues.on(self.queues.d2h):
            for i in piece:
                entry, grad = unit.unique[i], grads[i]
                target = buffer[entry.offset - start : entry.offset - start + entry.numel]
                if grad is None:
                    target.zero_()
                else:
                    target.copy_(grad.reshape(-1), non_blocking=True)
                    if self.queues.is_cuda:
                        grad.record_stream(self.queues.d2h)
        return buffer[:count], self.queues.record(self.queues.d2h)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.spill is not None:
            shutil.rmtree(self.spill.root, ignore_errors=True)
