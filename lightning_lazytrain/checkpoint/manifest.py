"""Checkpoint manifests: ``<name>.manifest.json`` lists the byte size and sha256 of every content that may sit at
``<name>``; a file is loaded only when one entry accepts it (``checkpoint/atomic.py`` says why two entries can).

Manifests are written the atomic way (temp file, fsync, rename, fsync of the directory), with the helpers the
checkpoint writer uses too.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
import warnings
from typing import Any

from lightning.fabric.utilities.types import _PATH

MANIFEST_SUFFIX = ".manifest.json"
_FORMAT = "lightning-lazytrain-checkpoint-manifest"


class CorruptCheckpointError(ValueError):
    """A checkpoint file is incomplete, altered, or has no manifest to check it against."""


def manifest_path(path: _PATH) -> str:
    return os.fspath(path) + MANIFEST_SUFFIX


def verify_checkpoint(path: _PATH) -> dict[str, Any]:
    """Check ``path`` against its manifest (size first, then sha256); return the manifest.

    A symlink (``ModelCheckpoint(save_last="link")``) is checked as the file it points to.
    Raises ``FileNotFoundError`` when there is no file and :class:`CorruptCheckpointError` when it does not verify.
    """
    shown = os.fspath(path)
    target = os.path.realpath(shown)
    if not os.path.isfile(target):
        raise FileNotFoundError(f"Checkpoint file not found: {shown}")
    manifest = _read_manifest(shown, target)
    accepted = manifest["accepts"]
    found = os.path.getsize(target)
    same_size = [e for e in accepted if e["size"] == found]
    if not same_size:
        expected = " or ".join(str(e["size"]) for e in accepted)
        kind = "truncated" if found < max(e["size"] for e in accepted) else "size mismatch"
        raise CorruptCheckpointError(
            f"{shown} is corrupt ({kind}): {expected} bytes expected, {found} bytes found. {_older_hint(target)}"
        )
    with open(target, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if all(e["sha256"] != digest for e in same_size):
        expected = " or ".join(e["sha256"] for e in same_size)
        raise CorruptCheckpointError(
            f"{shown} is corrupt (checksum mismatch): sha256 {digest} found, {expected} expected; the bytes changed"
            f" after they were written (disk or copy damage). {_older_hint(target)}"
        )
    return manifest


def find_last_good(dirpath: _PATH) -> str | None:
    """The newest ``*.ckpt`` in ``dirpath`` that verifies (newest by the save time its manifest records), or None.

    Newer checkpoints that do not verify are skipped with a warning naming each one and what is wrong with it.
    """
    directory = os.fspath(dirpath)
    if not os.path.isdir(directory):
        return None
    candidates = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.endswith(".ckpt") and os.path.isfile(path) and not os.path.islink(path):
            candidates.append((_saved_ns(path), name, path))
    for _, _, path in sorted(candidates, reverse=True):
        try:
            verify_checkpoint(path)
        except (CorruptCheckpointError, FileNotFoundError) as err:
            warnings.warn(f"skipping checkpoint {path}: {err}", stacklevel=2)
            continue
        return path
    return None


def write_manifest(target: str, accepts: list[dict[str, Any]], info: dict[str, Any]) -> None:
    body = {"format": _FORMAT, "version": 1, "file": os.path.basename(target), "saved_ns": time.time_ns(),
            "accepts": accepts, **{k: v for k, v in info.items() if isinstance(v, int)}}
    final = manifest_path(target)
    tmp = temp_name(final)
    try:
        with open(tmp, "w") as f:
            json.dump(body, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(os.path.dirname(os.path.abspath(final)))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def entries_for_current(target: str) -> list[dict[str, Any]]:
    """Manifest entries that may describe the file now at ``target`` (matched by size; the digest is not re-read)."""
    if not os.path.isfile(target):
        return []
    try:
        manifest = _read_manifest(target, target)
    except CorruptCheckpointError:
        return []  # the file being replaced never verified: there is nothing worth keeping loadable
    size = os.path.getsize(target)
    return [e for e in manifest["accepts"] if e["size"] == size]


def _read_manifest(shown: str, target: str) -> dict[str, Any]:
    path = manifest_path(target)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{shown} has no manifest ({path}): its save did not finish, or it was written by another CheckpointIO."
            " It cannot be checked, so it is not loaded; resume from a checkpoint saved by AtomicCheckpointIO."
        ) from None
    except (OSError, ValueError) as err:
        raise CorruptCheckpointError(f"{shown}: its manifest {path} is unreadable ({err})") from err
    entries = manifest.get("accepts") if isinstance(manifest, dict) else None
    valid = isinstance(entries, list) and entries and all(
        isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str) for e in entries)
    if manifest.get("format") != _FORMAT or not valid:
        raise CorruptCheckpointError(f"{shown}: its manifest {path} is not a lightning-lazytrain manifest")
    return manifest


def _older_hint(target: str) -> str:
    directory = os.path.dirname(target)
    return (f"Resume from an older checkpoint: lightning_lazytrain.find_last_good({directory!r}) finds the newest"
            " that verifies.")


def _saved_ns(path: str) -> int:
    try:
        with open(manifest_path(path)) as f:
            return int(json.load(f)["saved_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        return os.stat(path).st_mtime_ns  # no usable manifest: ordered by mtime, then refused by verification


def temp_name(target: str) -> str:
    directory, name = os.path.split(target)
    return os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
