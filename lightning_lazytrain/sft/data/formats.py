"""Reading SFT records from JSON / JSONL files or a local copy of a hub dataset, with errors that say where.

A record becomes a ``(prompt, response)`` pair of non-blank strings. MetaMathQA rows are ``{"query", "response"}``;
alpaca rows are ``{"instruction", "input", "output"}`` (the input, when non-empty, is appended to the instruction on a
new line). Anything else raises a :class:`DataError` naming the file, the line (or record), the field and the fix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lightning_lazytrain.sft.data.errors import DataError, DataFormatError, DataPathError, EmptyDataError

# files we read inside a local hub-dataset directory (e.g. a `huggingface-cli download` of meta-math/MetaMathQA)
_DATA_SUFFIXES = (".jsonl", ".json")
# JSON files in dataset directories that describe the data rather than hold it
_METADATA_NAMES = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"})
# Windows editors and Excel exports start UTF-8 files with it; it carries no data
_BOM = b"\xef\xbb\xbf"
_FORMATS = ("auto", "metamath", "alpaca", "custom")
_KEY_FIX = "Set prompt_key / response_key (or data_format) to the keys the rows use, or fix the row"


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
        if fmt in _FORMATS:
            return FieldMap(prompt, response, input)
        raise DataError(f"unknown data format {fmt!r}", f"Use one of {', '.join(map(repr, _FORMATS))}",
                        field="data_format")


def _decode(raw: bytes, source: str, line: int) -> str:
    """``raw`` as UTF-8; ``line`` is the line ``raw`` starts on."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        raise DataFormatError(source, line + raw.count(b"\n", 0, e.start), None,
                              f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start - line_start + 1})",
                              "Re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from e


def _parse(text: str, source: str, line: int, fix: str, extra_data_fix: str | None = None) -> object:
    """``text`` as JSON; ``line`` is the line ``text`` starts on. ``extra_data_fix`` replaces ``fix`` when a second
    value follows the first (a JSONL file named .json)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and extra_data_fix:
            fix = extra_data_fix
        problem = f"invalid JSON ({e.msg}, column {e.colno})"
        raise DataFormatError(source, line + e.lineno - 1, None, problem, fix) from e
    except RecursionError as e:
        raise DataFormatError(source, line, None, "JSON nested too deeply to parse", fix) from e
    except ValueError as e:  # an integer beyond Python's digit limit for int() (4300 by default)
        raise DataFormatError(source, line, None, "a number with too many digits to parse",
                              "Write the value as a string") from e


def _iter_raw_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed row). JSONL rows are numbered by line; a JSON array's rows by 1-based index."""
    source = str(path)
    try:
        if path.suffix == ".jsonl":
            # binary lines split on b"\n" only: text mode would also split on a stray "\r" and shift line numbers
            with path.open("rb") as f:
                for lineno, raw in enumerate(f, start=1):
                    if lineno == 1 and raw.startswith(_BOM):
                        raw = raw[len(_BOM) :]
                    text = _decode(raw.rstrip(b"\r\n"), source, lineno)
                    if text.strip():  # blank lines (a trailing newline, say) are not rows
                        yield lineno, _parse(text, source, lineno, "Each line of a .jsonl file must be one JSON object")
            return
        raw = path.read_bytes()
    except OSError as e:
        raise DataPathError(source, f"cannot be read ({e.strerror or e})", "Check the path and its permissions") from e
    data = _parse(_decode(raw.removeprefix(_BOM), source, 1), source, 1,
                  "Fix the JSON (a .json file holds one array of objects)",
                  extra_data_fix="The file holds several JSON values (one per line?): rename it to .jsonl")
    if isinstance(data, dict):
        # {"train": [...]} style files: take the single list value if there is exactly one
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataFormatError(source, 1, None, f"an object with {len(lists)} list values, not one array",
                                  "Make the file a JSON array of objects (or an object holding exactly one)")
        data = lists[0]
    if not isinstance(data, list):
        raise DataFormatError(source, 1, None, f"expected a JSON array of objects, got {type(data).__name__}",
                              "Make the file a JSON array of objects")
    yield from enumerate(data, start=1)


def _text_field(row: dict, key: str, source: str, line: int, required: bool = True) -> str:
    if key not in row or row[key] is None:
        if not required:
            return ""
        raise DataFormatError(source, line, key, f"missing (row has keys {sorted(row)})", _KEY_FIX)
    value = row[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise DataFormatError(source, line, key, f"non-finite number {value}", "Write the value as a string")
        return str(value)  # numeric answers are common in math sets; accept them as text
    if not isinstance(value, str):
        raise DataFormatError(source, line, key, f"expected a string, got {type(value).__name__}",
                              "Make the value a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        # an unpaired \\ud800-\\udfff escape: valid JSON, but no tokenizer can encode it
        raise DataFormatError(source, line, key, f"lone surrogate {value[e.start]!r} at character {e.start}",
                              "Fix the \\u escape (a surrogate needs its pair) or remove the row") from e
    return value


def _resolve_fields(row: dict, fields: FieldMap, fmt: str) -> FieldMap:
    if fmt == "auto" and fields.prompt not in row and "instruction" in row and "output" in row:
        return FieldMap.for_format("alpaca")
    return fields


def _record(row: object, fields: FieldMap, fmt: str, source: str, line: int) -> Record:
    if not isinstance(row, dict):
        raise DataFormatError(source, line, None, f"expected a JSON object, got {type(row).__name__}",
                              "Make every row an object such as {\"query\": ..., \"response\": ...}")
    f = _resolve_fields(row, fields, fmt)
    prompt = _text_field(row, f.prompt, source, line)
    if f.input:
        extra = _text_field(row, f.input, source, line, required=False)
        if extra.strip():
            prompt = f"{prompt}\n{extra}"
    response = _text_field(row, f.response, source, line)
    if not prompt.strip():
        raise DataFormatError(source, line, f.prompt, "empty prompt", "Fill it in or remove the row")
    if not response.strip():
        raise DataFormatError(source, line, f.response, "empty response (nothing to train on)",
                              "Fill it in or remove the row")
    return Record(prompt, response, source, line)


def read_records(path: str | Path, fields: FieldMap | None = None, fmt: str = "auto") -> list[Record]:
    """All records of a .json/.jsonl file, or of every such file in a directory (a local hub dataset), in order.

    Raises :class:`DataError` for any bad input (never returns an empty list).
    """
    fields = fields or FieldMap()
    files = data_files(Path(path).expanduser())
    records = [_record(row, fields, fmt, str(file), line) for file in files for line, row in _iter_raw_rows(file)]
    if not records:
        names = ", ".join(str(f) for f in files)
        raise EmptyDataError("no records (the data files are empty or hold only blank lines)",
                             "Point data_path at the data, or check the download finished", source=names)
    return records


def data_files(path: Path) -> list[Path]:
    """The data files behind ``path``: itself, or the JSON/JSONL files of a dataset directory, sorted by name."""
    if path.is_file():
        if path.suffix not in _DATA_SUFFIXES:
            raise DataPathError(str(path), f"unsupported data file type {path.suffix!r}",
                                "Use a .json or .jsonl file (or a folder of them)")
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
            raise DataPathError(str(path), "no .json or .jsonl data files in this directory",
                                "Point data_path at the folder holding the data files (hub downloads: data/)")
        return files
    raise DataPathError(str(path), "data path does not exist",
                        "Fix data_path (hub names are read only from a local download, e.g. huggingface-cli download)")
