"""The spill disk's read and write speed, probed with a temporary file that never outlives the probe."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from lightning_lazytrain.faults import spill_write_failed


def measure_disk(spill_dir: str, nbytes: int) -> tuple[float, float]:
    """(read, write) bytes/s of a temp file in ``spill_dir``: write + fsync, drop it from the page cache, read.

    The file is removed before returning, also on error; a full or failing disk raises a ``SpillError``.
    """
    os.makedirs(spill_dir, exist_ok=True)
    # a speed probe must not be what fills a small spill disk: a quarter of its free space at most
    nbytes = max(1, min(nbytes, shutil.disk_usage(spill_dir).free // 4))
    chunk = min(nbytes, 16 << 20)
    buf = os.urandom(chunk)
    try:
        return _probe(spill_dir, nbytes, buf)
    except OSError as exc:
        raise spill_write_failed(spill_dir, spill_dir, "the disk-speed probe", nbytes, exc) from exc


def _probe(spill_dir: str, nbytes: int, buf: bytes) -> tuple[float, float]:
    chunk = len(buf)
    fd, path = tempfile.mkstemp(prefix=".lazytrain-probe-", suffix=".bin", dir=spill_dir)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, buf[: min(chunk, nbytes - written)])
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)
        fd = -1
        fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not the page cache
        t0 = time.perf_counter()
        while os.read(fd, chunk):
            pass
        read_s = time.perf_counter() - t0
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)
    return written / max(read_s, 1e-9), written / max(write_s, 1e-9)
