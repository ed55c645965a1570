"""Checkpoint files that survive a kill at any moment, and are checked before they are unpickled.

A save writes ``.<name>.<pid>.<token>.tmp`` beside the target, flushes and fsyncs it, renames it over the target and
fsyncs the directory. Every checkpoint has a manifest, ``<name>.manifest.json`` (``checkpoint/manifest.py``, written
the same atomic way), that lists the byte size and sha256 of the contents that may sit at ``<name>``.

The window between renaming the checkpoint and rewriting its manifest is closed by ordering: just before the rename
the manifest is rewritten to accept BOTH the old contents and the new ones; after the rename it is rewritten to
accept only the new ones. A kill at any point therefore leaves one of:

* old file, old manifest (killed before the first manifest rename),
* old file, manifest accepting old and new (killed before the checkpoint rename),
* new file, manifest accepting old and new (killed before the last manifest rename),
* new file, new manifest,

and each of them verifies. A file with no manifest, or whose size or digest no manifest entry accepts, is refused
with :class:`CorruptCheckpointError` before ``torch.load`` sees a byte of it; loading uses ``weights_only=True``, and
saving refuses objects that such a load would reject, so the error comes at the first save, not at the resume.
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from lightning_lazytrain.checkpoint.manifest import (
    CorruptCheckpointError,
    entries_for_current,
    find_last_good,
    fsync_dir,
    manifest_path,
    temp_name,
    verify_checkpoint,
    write_manifest,
)

__all__ = ["AtomicCheckpointIO", "CorruptCheckpointError", "find_last_good", "manifest_path", "verify_checkpoint"]

_TEMP = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{16}\.tmp$")
_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_CONTAINER_TYPES = (dict, collections.OrderedDict, list, tuple, set)


def remove_stale_temps(dirpath: _PATH) -> list[str]:
    """Delete temp files that a killed save left in ``dirpath`` (their writer process is gone); return their paths."""
    directory = os.fspath(dirpath)
    removed = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        match = _TEMP.match(name)
        if match and not _process_alive(int(match.group(1))):
            path = os.path.join(directory, name)
            try:
                os.remove(path)
            except FileNotFoundError:
                continue  # another process cleaned it first
            removed.append(path)
    return removed


def check_weights_only_loadable(obj: Any, path: _PATH) -> None:
    """Raise ``TypeError`` naming the first value that ``torch.load(weights_only=True)`` would refuse to rebuild."""
    safe = {g[0] if isinstance(g, tuple) else g for g in torch.serialization.get_safe_globals()}
    stack: list[tuple[str, Any]] = [("checkpoint", obj)]
    while stack:
        where, value = stack.pop()
        kind = type(value)
        if kind in _LEAF_TYPES or kind in (torch.Tensor, torch.nn.Parameter) or kind in safe:
            continue
        if kind not in _CONTAINER_TYPES:
            raise TypeError(
                f"cannot save {os.fspath(path)}: {where} is a {kind.__module__}.{kind.__qualname__}, which"
                " torch.load(weights_only=True) refuses to rebuild, so the checkpoint could not be resumed from."
                " Store it as plain data (str, numbers, lists, dicts, tensors), or register the class with"
                " torch.serialization.add_safe_globals([...]) if it is safe to unpickle."
            )
        if isinstance(value, dict):
            stack.extend((f"{where}[{k!r}] (key)", k) for k in value)
            stack.extend((f"{where}[{k!r}]", v) for k, v in value.items())
        else:
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic and whose loads are verified against a sha256 manifest.

    Local paths only: the rename and fsync guarantees have no equivalent on object stores.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r})")
        target = _local(path)
        directory = os.path.dirname(os.path.abspath(target))
        os.makedirs(directory, exist_ok=True)
        remove_stale_temps(directory)
        check_weights_only_loadable(checkpoint, target)
        tmp = temp_name(target)
        try:
            entry = _write_hashed(checkpoint, tmp)
            info = {"global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}
            write_manifest(target, [entry, *entries_for_current(target)], info)
            os.replace(tmp, target)
            fsync_dir(directory)
            write_manifest(target, [entry], info)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(
                f"{type(self).__name__} loads with weights_only=True only (what it saves never needs more); drop"
                f" weights_only=False, or load {os.fspath(path)} with lightning's TorchCheckpointIO if you trust it."
            )
        target = _local(path)
        remove_stale_temps(os.path.dirname(os.path.abspath(target)))  # a resume is the first chance after a crash
        verify_checkpoint(target)
        return torch.load(target, map_location=map_location, weights_only=True)

    def remove_checkpoint(self, path: _PATH) -> None:
        target = _local(path)
        # the checkpoint goes first: a kill in between leaves a manifest with no file (ignored), never a file with
        # no manifest (which would read as corrupt)
        for victim in (target, manifest_path(target)):
            if os.path.lexists(victim):
                os.remove(victim)


class _HashingWriter:
    """File-like object for ``torch.save`` that hashes and counts the bytes on their way to the real file."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # the first failed write (a full disk), which torch.save then hides

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        try:
            written = self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.size += written
        return written

    def flush(self) -> None:
        self.file.flush()


def _write_hashed(obj: Any, tmp: str) -> dict[str, Any]:
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError as exc:
            # torch's zip writer answers a failed write by failing to close the archive ("unexpected pos"), which
            # hides the cause: the disk's own error is the one to report
            if writer.error is None:
                raise
            err = writer.error
            raise OSError(err.errno, f"{err.strerror}: writing checkpoint {tmp} failed after {writer.size} bytes;"
                          " the previous checkpoint is left as it was") from exc
        f.flush()
        os.fsync(f.fileno())
    return {"size": writer.size, "sha256": writer.sha256.hexdigest()}


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # our own temp: a save in flight on another thread (AsyncCheckpointIO)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _local(path: _PATH) -> str:
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(
            f"AtomicCheckpointIO writes local files only (atomic rename and fsync), got {text}; save locally and"
            " copy, or pass checkpoint_io=TorchCheckpointIO() for remote storage without these guarantees"
        )
    return text.removeprefix("file://")
