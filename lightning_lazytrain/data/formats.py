"""Reading SFT records from JSON / JSONL files or a local copy of a hub dataset, with errors that say where.

A record becomes a ``(prompt, response)`` pair of strings. MetaMathQA rows are ``{"query", "response"}``; alpaca rows
are ``{"instruction", "input", "output"}`` (the input, when non-empty, is appended to the instruction on a new line).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# files we read inside a local hub-dataset directory (e.g. a `huggingface-cli download` of meta-math/MetaMathQA)
_DATA_SUFFIXES = (".jsonl", ".json")
# JSON files in dataset directories that describe the data rather than hold it
_METADATA_NAMES = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"})


class DataFormatError(ValueError):
    """A malformed record: the message names the file, the line (or record index) and the field."""

    def __init__(self, source: str, line: int, field: str | None, problem: str) -> None:
        where = f"{source}:{line}" + (f" field {field!r}" if field else "")
        super().__init__(f"{where}: {problem}")
        self.source, self.line, self.field, self.problem = source, line, field, problem


@dataclass(frozen=True)
class Record:
    """One prompt/response pair and where it came from (kept so later errors can point back at the file)."""

    prompt: str
    response: str
    source: str
    line: int


@dataclass(frozen=True)
class FieldMap:
    """Which keys of a row hold the prompt, the optional extra input, and the response."""

    prompt: str = "query"
    response: str = "response"
    input: str | None = None

    @staticmethod
    def for_format(fmt: str, prompt: str = "query", response: str = "response", input: str | None = None) -> FieldMap:
        if fmt == "alpaca":
            return FieldMap("instruction", "output", "input")
        if fmt in ("metamath", "custom", "auto"):
            return FieldMap(prompt, response, input)
        raise ValueError(f"unknown data format {fmt!r}; use 'metamath', 'alpaca', 'custom' or 'auto'")


def _iter_raw_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed row). JSONL rows are numbered by line; a JSON array's rows by 1-based index."""
    text_source = str(path)
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue  # blank lines (a trailing newline, say) are not rows
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataFormatError(text_source, lineno, None, f"invalid JSON ({e.msg})") from e
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataFormatError(text_source, e.lineno, None, f"invalid JSON ({e.msg})") from e
    if isinstance(data, dict):
        # {"train": [...]} style files: take the single list value if there is exactly one
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataFormatError(text_source, 1, None, "expected a JSON array (or one list in an object)")
        data = lists[0]
    if not isinstance(data, list):
        raise DataFormatError(text_source, 1, None, "expected a JSON array of objects")
    yield from enumerate(data, start=1)


def _text_field(row: dict, key: str, source: str, line: int, required: bool = True) -> str:
    if key not in row or row[key] is None:
        if not required:
            return ""
        raise DataFormatError(source, line, key, f"missing (row has keys {sorted(row)})")
    value = row[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # numeric answers are common in math sets; accept them as text
    if not isinstance(value, str):
        raise DataFormatError(source, line, key, f"expected a string, got {type(value).__name__}")
    return value


def _resolve_fields(row: dict, fields: FieldMap, fmt: str) -> FieldMap:
    if fmt == "auto" and fields.prompt not in row and "instruction" in row and "output" in row:
        return FieldMap.for_format("alpaca")
    return fields


def read_records(path: str | Path, fields: FieldMap | None = None, fmt: str = "auto") -> list[Record]:
    """All records of a .json/.jsonl file, or of every such file in a directory (a local hub dataset), in order."""
    fields = fields or FieldMap()
    files = data_files(Path(path).expanduser())
    records: list[Record] = []
    for file in files:
        source = str(file)
        for line, row in _iter_raw_rows(file):
            if not isinstance(row, dict):
                raise DataFormatError(source, line, None, f"expected a JSON object, got {type(row).__name__}")
            f = _resolve_fields(row, fields, fmt)
            prompt = _text_field(row, f.prompt, source, line)
            if f.input:
                extra = _text_field(row, f.input, source, line, required=False)
                if extra.strip():
                    prompt = f"{prompt}\n{extra}"
            response = _text_field(row, f.response, source, line)
            if not prompt.strip():
                raise DataFormatError(source, line, f.prompt, "empty prompt")
            records.append(Record(prompt, response, source, line))
    return records


def data_files(path: Path) -> list[Path]:
    """The data files behind ``path``: itself, or the JSON/JSONL files of a dataset directory, sorted by name."""
    if path.is_file():
        if path.suffix not in _DATA_SUFFIXES:
            raise ValueError(f"{path}: unsupported data file type {path.suffix!r}; use .json or .jsonl")
        return [path]
    if path.is_dir():
        # hub layouts put files at the top or under data/; skip hidden dirs such as .cache/.git
        files = sorted(
            p
            for p in path.rglob("*")
            if p.suffix in _DATA_SUFFIXES
            and p.is_file()
            and p.name not in _METADATA_NAMES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise FileNotFoundError(f"{path}: no .json or .jsonl data files in this directory")
        return files
    raise FileNotFoundError(f"data path {path} does not exist (hub names are read only from a local download)")
