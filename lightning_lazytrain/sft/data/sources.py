"""Where SFT rows come from: local files and folders, or any dataset ``datasets.load_dataset`` can open.

Rows come out as ``(source, line, row)`` so every later error can point back at them: ``line`` is the line of a
.jsonl file, else the 1-based row of a .json array, a .parquet/.csv file or a loaded dataset. JSON files go through
our own reader (`jsonrows`, which knows lines); parquet, CSV and hub datasets through ``datasets``, imported only
when such a source is asked for.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_lazytrain.sft.data.errors import DataFormatError, DataPathError
from lightning_lazytrain.sft.data.jsonrows import iter_json_rows

_JSON_SUFFIXES = (".jsonl", ".json")
_TABLE_BUILDERS = {".parquet": "parquet", ".csv": "csv"}
DATA_SUFFIXES = (*_JSON_SUFFIXES, *_TABLE_BUILDERS)
# JSON files in dataset directories that describe the data rather than hold it
_METADATA_NAMES = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"})
# split names hub layouts put in file or folder names (data/train-00000-of-00001.parquet, test.jsonl)
_SPLIT_NAMES = frozenset({"train", "test", "validation", "valid", "dev", "eval"})
#: prefix of a ``data_path`` that names a dataset for ``datasets.load_dataset`` (``hf:meta-math/MetaMathQA``):
#: explicit, because "data/MetaMathQA" is both a relative path and a hub name
HUB_PREFIX = "hf:"
_SUFFIX_LIST = ", ".join(DATA_SUFFIXES)


@dataclass(frozen=True)
class DataSource:
    """``path``: a file, a folder of data files, or ``hf:NAME`` for ``datasets.load_dataset(NAME)`` (a hub name or
    a local dataset folder, read through the datasets cache); ``split``/``revision``/``cache_dir`` go to
    ``load_dataset`` (``split`` also picks the files of a folder whose names carry split names)."""

    path: str
    split: str = "train"
    revision: str | None = None
    cache_dir: str | None = None


def _split_of(part: str) -> str:
    return re.split(r"[-_.]", part, maxsplit=1)[0].lower()


def _files_of_split(files: list[Path], root: Path, split: str) -> list[Path]:
    named = [f for f in files if any(_split_of(p) in _SPLIT_NAMES for p in f.relative_to(root).parts)]
    if not named:
        return files
    return [f for f in named if any(_split_of(p) == split for p in f.relative_to(root).parts)] or files


def data_files(path: Path, split: str = "train") -> list[Path]:
    """The data files behind a local ``path``: itself, or the data files of a folder (those of ``split`` when the
    names carry splits), sorted by name."""
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise DataPathError(
                str(path),
                f"unsupported data file type {path.suffix!r}",
                f"Use one of {_SUFFIX_LIST} (or a folder of them)",
            )
        return [path]
    if path.is_dir():
        # hub layouts put files at the top or under data/; skip hidden dirs such as .cache/.git
        files = sorted(
            p
            for p in path.rglob("*")
            if p.suffix in DATA_SUFFIXES
            and p.is_file()
            and p.name not in _METADATA_NAMES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataPathError(
                str(path),
                f"no data files ({_SUFFIX_LIST}) in this directory",
                "Point data_path at the folder holding the data files (hub downloads: data/)",
            )
        return _files_of_split(files, path, split)
    raise DataPathError(
        str(path),
        "data path does not exist",
        f"Fix data_path (a file or a folder; {HUB_PREFIX}owner/name loads a hub dataset, or download it first with "
        "huggingface-cli download)",
    )


def is_dataset_name(path: str) -> bool:
    """Whether ``path`` names a dataset for ``datasets.load_dataset`` (``hf:NAME``) rather than a local path."""
    return path.startswith(HUB_PREFIX)


def _table_rows(file: Path, cache_dir: str | None) -> Iterator[tuple[int, object]]:
    import datasets

    try:
        table = datasets.load_dataset(
            _TABLE_BUILDERS[file.suffix], data_files=str(file), split="train", cache_dir=cache_dir
        )
    except Exception as e:  # pyarrow/pandas raise many kinds; all mean "this file cannot be read as its type"
        raise DataFormatError(
            str(file),
            1,
            None,
            f"cannot be read as {file.suffix[1:]} ({type(e).__name__}: {e})",
            f"Check the file is a valid {file.suffix[1:]} file",
        ) from e
    yield from enumerate(table, start=1)


def _load_dataset(source: DataSource) -> Any:
    import datasets

    try:
        return datasets.load_dataset(
            source.path.removeprefix(HUB_PREFIX),
            split=source.split,
            revision=source.revision,
            cache_dir=source.cache_dir,
        )
    except Exception as e:  # offline, unknown name, unknown split, ... : all are a data_path the user must change
        raise DataPathError(
            source.path,
            f"datasets.load_dataset failed ({type(e).__name__}: {e})",
            "Check data_path / data_split / data_revision, or download the dataset first (offline "
            "machines: HF_DATASETS_OFFLINE=1 with the dataset in the cache)",
        ) from e


def iter_rows(source: DataSource) -> Iterator[tuple[str, int, object]]:
    """Every row of ``source`` as ``(source name, line or row, row)``, in order."""
    if is_dataset_name(source.path):
        name = f"{source.path.removeprefix(HUB_PREFIX)}[{source.split}]"
        yield from ((name, i, row) for i, row in enumerate(_load_dataset(source), start=1))
        return
    for file in data_files(Path(source.path).expanduser(), source.split):
        rows = iter_json_rows(file) if file.suffix in _JSON_SUFFIXES else _table_rows(file, source.cache_dir)
        yield from ((str(file), line, row) for line, row in rows)


def fingerprint(source: DataSource) -> str:
    """A digest of the data itself: the files' bytes, or a loaded dataset's own fingerprint (its cache key)."""
    digest = hashlib.blake2b(digest_size=16)
    if is_dataset_name(source.path):
        digest.update(f"{source.path}|{source.split}|{source.revision}".encode())
        digest.update(str(getattr(_load_dataset(source), "_fingerprint", "")).encode())
        return digest.hexdigest()
    for file in data_files(Path(source.path).expanduser(), source.split):
        digest.update(str(file.name).encode())
        with file.open("rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
