"""Resource faults (the spill disk, page-locked host memory) as one error type that says what to change.

The engine catches the OS failure where it happens (a spill write on an I/O thread, a pin at setup) and raises what
a function here builds, so every message has the same parts, worded in one place: the resource, the problem, the
bytes asked and available where they are known, and the settings that would avoid it.
"""

from __future__ import annotations

import errno
import os
import re
import resource as _rlimit
import shutil
from collections.abc import Sequence

import psutil

_FEWER_NVME = "use a plan with fewer 'nvme' homes (schedule='interval:K', or a plan JSON with 'cpu'/'recompute' there)"
_OTHER_DIR = "point spill_dir at another local disk"


def human_bytes(n: int) -> str:
    """``n`` bytes with a binary unit, e.g. ``'160.0 KiB'``."""
    size, unit = float(n), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{int(size)} bytes" if unit == "bytes" else f"{size:.1f} {unit}"


class ResourceError(RuntimeError):
    """A resource ran out or went away. ``asked``/``available`` are bytes (``None``: not known or not relevant);
    ``change`` lists what the user can change, in the order worth trying."""

    def __init__(self, resource: str, problem: str, change: Sequence[str], asked: int | None = None,
                 available: int | None = None) -> None:
        self.resource, self.problem, self.change = resource, problem, tuple(change)
        self.asked, self.available = asked, available
        amounts = []
        if asked is not None:
            amounts.append(f"asked for {asked} bytes ({human_bytes(asked)})")
        if available is not None:
            amounts.append(f"{available} bytes ({human_bytes(available)}) available")
        detail = f" ({', '.join(amounts)})" if amounts else ""
        super().__init__(f"lazytrain: {resource}: {problem}{detail}. To fix: " + "; or ".join(self.change) + ".")


class SpillError(ResourceError):
    """The spill directory cannot take (or give back) a boundary: missing, unwritable, full, gone, or unreadable."""


class PinnedMemoryError(ResourceError, MemoryError):
    """Page-locked host memory could not be allocated. Also a ``MemoryError``, as the plain error was before."""


def _free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None  # the disk itself is gone


def spill_dir_missing(spill_dir: str) -> SpillError:
    return SpillError(f"spill_dir {spill_dir!r}", "does not exist or is not a directory",
                      ["create it on a fast local disk (NVMe), mount that disk, or pass another spill_dir"])


def spill_dir_unusable(spill_dir: str, exc: OSError) -> SpillError:
    """The run's folder cannot be created in ``spill_dir`` (at setup)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return SpillError(f"spill_dir {spill_dir!r}", "is full: not even the run's folder can be created",
                          ["free space there", _OTHER_DIR], available=_free_bytes(spill_dir))
    return SpillError(f"spill_dir {spill_dir!r}", f"cannot create the run's folder ({exc.strerror or exc})",
                      ["make it writable for this user", _OTHER_DIR])


def _gone(spill_dir: str, root: str, action: str, what: str) -> SpillError:
    return SpillError(f"spill_dir {spill_dir!r}",
                      f"the run's folder {root!r} disappeared (deleted, or the disk unmounted) while {action} {what}",
                      ["keep spill_dir mounted and out of reach of tmp cleaners while training", _OTHER_DIR,
                       "use a plan without 'nvme' homes"], available=_free_bytes(spill_dir))


def spill_write_failed(spill_dir: str, root: str, what: str, nbytes: int, exc: OSError) -> SpillError:
    """A write of ``nbytes`` (boundary ``what``) into the run's folder ``root`` failed with ``exc``."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(spill_dir)
        budget = f"set nvme_activation_gib below the free space ({human_bytes(free)})" if free is not None else \
            "lower nvme_activation_gib"
        return SpillError(f"spill_dir {spill_dir!r}", f"is full writing {what}",
                          [f"{budget} so the plan keeps fewer boundaries on NVMe", "point spill_dir at a larger disk",
                           _FEWER_NVME], asked=nbytes, available=free)
    if exc.errno == errno.ENOENT and not os.path.isdir(root):
        return _gone(spill_dir, root, "writing", what)
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return SpillError(f"spill_dir {spill_dir!r}", f"refused the write of {what} ({exc.strerror or exc})",
                          ["remount the disk read-write or make spill_dir writable", _OTHER_DIR], asked=nbytes)
    return SpillError(f"spill_dir {spill_dir!r}", f"failed writing {what} ({exc.strerror or exc})",
                      ["check the disk (dmesg, SMART)", _OTHER_DIR, _FEWER_NVME], asked=nbytes)


def spill_read_failed(spill_dir: str, root: str, what: str, nbytes: int, exc: OSError) -> SpillError:
    """Reading boundary ``what`` (``nbytes``) back from the run's folder ``root`` failed with ``exc``."""
    if exc.errno == errno.ENOENT and not os.path.isdir(root):
        return _gone(spill_dir, root, "reading back", what)
    return SpillError(f"spill_dir {spill_dir!r}", f"failed reading {what} back ({exc.strerror or exc})",
                      ["check the disk and that nothing else writes into spill_dir", _OTHER_DIR, _FEWER_NVME],
                      asked=nbytes)


def pin_failed(nbytes: int, pinned_so_far: int, exc: BaseException | None) -> PinnedMemoryError:
    """Page-locking ``nbytes`` more failed after ``pinned_so_far`` bytes were pinned."""
    soft, _ = _rlimit.getrlimit(_rlimit.RLIMIT_MEMLOCK)
    limit = "" if soft == _rlimit.RLIM_INFINITY else f"; the locked-memory limit (ulimit -l) is {human_bytes(soft)}"
    cause = f": {exc}" if exc is not None else ""
    return PinnedMemoryError(
        "pinned host memory",
        f"could not page-lock another buffer with {human_bytes(pinned_so_far)} pinned so far{limit}{cause}",
        ["pass pin_memory=False to LazyTrainStrategy (copies to the GPU get slower but need no locked memory)",
         "free host RAM or raise the locked-memory limit (ulimit -l unlimited; docker --ulimit memlock=-1)",
         "lower cpu_activation_gib so fewer boundaries wait in pinned buffers"],
        asked=nbytes, available=psutil.virtual_memory().available)


class GpuMemoryError(ResourceError):
    """The device ran out of memory inside a training step: the plan's budget and the step's working set did not
    fit. Also raised for the first steps, where a smaller budget would be the fix, rather than retried silently."""


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def gpu_out_of_memory(exc: BaseException, available: int | None, batch_shape: tuple[int, int] | None,
                      plan: str) -> GpuMemoryError:
    """``exc`` is torch's OutOfMemoryError; the size it tried to allocate is read from its message. ``plan``: the
    plan that ran out, in a line (`planning.oom_ladder.plan_summary`)."""
    found = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", str(exc))
    asked = int(float(found.group(1)) * _UNITS[found.group(2)]) if found else None
    # an MILP plan's shape: the largest batch so far, which the plan was solved for (`planning/replan.py`)
    shape = f" for batch {batch_shape[0]} x {batch_shape[1]}" if batch_shape else ""
    return GpuMemoryError(
        "GPU memory", f"out of memory inside a training step (plan{shape}: {plan})",
        ["a smaller batch with accumulate_grad_batches to keep the global batch",
         "a smaller gpu_activation_gib, so that schedule='milp' sends more boundaries to 'cpu' or 'recompute'",
         "fewer keep_graph_layers",
         "a larger layer_micro_batches (each layer runs the batch in that many row slices; same gradients)",
         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True when the step fails close to the limit (fragmentation)"],
        asked=asked, available=available)
