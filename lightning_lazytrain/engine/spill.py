"""This process's folder in the user's spill directory: raw-byte files for boundaries that live on NVMe.

Each process writes into its own ``<spill_dir>/lazytrain-<pid>-<random>`` folder, removed at teardown; a run that
was killed cannot do that, so every start removes the folders of processes that are no longer alive. Errors name
the spill directory and say what to change, because the user chose the disk and the NVMe budget.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile

_FOLDER = re.compile(r"^lazytrain-(\d+)-")


class SpillError(RuntimeError):
    """The spill directory cannot take (or give back) a boundary: missing, unwritable, full, or unreadable."""


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
            raise SpillError(f"lazytrain spill_dir {spill_dir!r} does not exist or is not a directory; create it on "
                             "a fast local disk (NVMe) or pass another spill_dir")
        self.spill_dir = spill_dir
        remove_dead_leftovers(spill_dir)
        try:
            self.root = tempfile.mkdtemp(prefix=f"lazytrain-{os.getpid()}-", dir=spill_dir)
        except OSError as exc:
            raise SpillError(f"lazytrain cannot create its folder in spill_dir {spill_dir!r}: {exc}. Make it "
                             "writable for this user or choose another spill_dir.") from exc

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
            raise self._write_error(path, len(data), what, exc) from exc

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
            raise SpillError(f"lazytrain could not read {what} back from {path!r}: {exc}") from exc

    def remove(self, name: str) -> None:
        try:
            os.remove(self.path(name))
        except FileNotFoundError:
            pass

    def _write_error(self, path: str, nbytes: int, what: str, exc: OSError) -> SpillError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(self.spill_dir).free
            return SpillError(
                f"lazytrain ran out of disk space in spill_dir {self.spill_dir!r} writing {what}: asked for {nbytes} "
                f"bytes ({nbytes / 2**30:.3f} GiB), {free} bytes ({free / 2**30:.3f} GiB) free. Point spill_dir at "
                "a larger disk, or lower the NVMe activation budget so fewer boundaries spill."
            )
        return SpillError(f"lazytrain could not write {what} to {path!r} in spill_dir {self.spill_dir!r}: {exc}")
