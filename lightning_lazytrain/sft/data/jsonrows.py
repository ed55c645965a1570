"""JSON and JSONL files read row by row, with errors that name the file, the line and what to change.

Our own reader rather than ``datasets``' JSON builder: a bad row must be reported at its line (a JSONL file is
read in binary so a stray ``\r`` does not shift line numbers), which pyarrow's reader does not say.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from lightning_lazytrain.sft.data.errors import DataFormatError, DataPathError

# Windows editors and Excel exports start UTF-8 files with it; it carries no data
_BOM = b"\xef\xbb\xbf"


def _decode(raw: bytes, source: str, line: int) -> str:
    """``raw`` as UTF-8; ``line`` is the line ``raw`` starts on."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        raise DataFormatError(
            source,
            line + raw.count(b"\n", 0, e.start),
            None,
            f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start - line_start + 1})",
            "Re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        ) from e


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
        raise DataFormatError(
            source, line, None, "a number with too many digits to parse", "Write the value as a string"
        ) from e


def iter_json_rows(path: Path) -> Iterator[tuple[int, object]]:
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
    data = _parse(
        _decode(raw.removeprefix(_BOM), source, 1),
        source,
        1,
        "Fix the JSON (a .json file holds one array of objects)",
        extra_data_fix="The file holds several JSON values (one per line?): rename it to .jsonl",
    )
    if isinstance(data, dict):
        # {"train": [...]} style files: take the single list value if there is exactly one
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataFormatError(
                source,
                1,
                None,
                f"an object with {len(lists)} list values, not one array",
                "Make the file a JSON array of objects (or an object holding exactly one)",
            )
        data = lists[0]
    if not isinstance(data, list):
        raise DataFormatError(
            source,
            1,
            None,
            f"expected a JSON array of objects, got {type(data).__name__}",
            "Make the file a JSON array of objects",
        )
    yield from enumerate(data, start=1)
