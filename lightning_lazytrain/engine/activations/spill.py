"""This process's folder in the user's spill directory: raw-byte files for boundaries that live on NVMe.

Each process writes into its own ``<spill_dir>/lazytrain-<pid>-<random>`` folder, removed at teardown; a run that
was killed cannot do that, so every start removes the folders of processes that are no longer alive. Errors are
``SpillError`` s built in :mod:`lightning_lazytrain.faults`: they name the spill directory, the bytes asked and free,
and say what to change, because the user chose the disk and the NVMe budget.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile

from lightning_lazytrain import faults
from lightning_lazytrain.faults import SpillError

__all__ = ["SpillDir", "SpillError", "remove_dead_leftovers"]

_FOLDER = re.compile(r"^lazytrain-(\d+)-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only checks existence
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return True


def remove_dead_leftovers(spill_dir: str) -> list[str]:
    """Remove the folders of crashed runs (their pid is gone); live runs' folders, ours included, stay."""
    removed = []
    for name in os.listdir(spill_dir):
        match = _FOLDER.match(name)
        if match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(spill_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


def _write_all(fd: int, data: memoryview) -> None:
    # os.write may write less than asked (Linux caps one call near 2 GiB), so loop. Module level: tests patch it.
    while len(data):
        data = data[os.write(fd, data) :]


def _read_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.readv(fd, [data])
        if n == 0:
            raise OSError(errno.EIO, "file shorter than expected (modified or truncated?)")
        data = data[n:]


class SpillDir:
    def __init__(self, spill_dir: str) -> None:
        # A missing folder is refused, not created: it is often an unmounted disk, and creating it would spill onto
        # the root file system instead.
        if not os.path.isdir(spill_dir):
            raise faults.spill_dir_missing(spill_dir)
        self.spill_dir = spill_dir
        try:
            remove_dead_leftovers(spill_dir)
            self.root = tempfile.mkdtemp(prefix=f"lazytrain-{os.getpid()}-", dir=spill_dir)
        except OSError as exc:
            raise faults.spill_dir_unusable(spill_dir, exc) from exc

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def write(self, name: str, data: memoryview, what: str) -> None:
        """Write ``data`` to a new file ``name``; on failure no file is left behind."""
        path = self.path(name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            self.remove(name)  # a partial file would only waste the disk that just ran out
            raise faults.spill_write_failed(self.spill_dir, self.root, what, len(data), exc) from exc

    def read(self, name: str, data: memoryview, what: str) -> None:
        """Fill ``data`` from file ``name`` and delete the file (each spill is read back once)."""
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                _read_all(fd, data)
            finally:
                os.close(fd)
            os.remove(path)
        except OSError as exc:
            raise faults.spill_read_failed(self.spill_dir, self.root, what, len(data), exc) from exc

    def remove(self, name: str) -> None:
        try:
            os.remove(self.path(name))
        except FileNotFoundError:
            pass
