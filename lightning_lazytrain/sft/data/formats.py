"""SFT row formats: each row becomes a :class:`Record`, a conversation of (role, content) turns.

* ``messages``: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}`` (multi-turn);
* ``sharegpt``: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}``;
* ``alpaca``: ``{"instruction", "input", "output"}`` (a non-empty input goes on a new line after the instruction);
* ``prompt_completion``: ``{"prompt", "completion"}``;
* ``metamath`` / ``custom``: ``prompt_key`` / ``response_key`` (MetaMathQA's ``query`` / ``response``);
* ``text``: ``{"text"}``, continued pre-training: the loss is on every token.

``auto`` picks the format from the first row's keys. Anything else raises a :class:`DataFormatError` naming the
file, the line (or row), the field and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from lightning_lazytrain.sft.data.errors import DataError, DataFormatError, EmptyDataError
from lightning_lazytrain.sft.data.sources import DataSource, data_files, is_dataset_name, iter_rows

FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text", "metamath", "custom")
#: the role of a plain-text record's single turn
TEXT_ROLE = "text"
_ROLES = ("system", "user", "assistant")
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
_KEY_FIX = "Set data_format (or prompt_key / response_key) to match the rows, or fix the row"


@dataclass(frozen=True)
class Record:
    """One conversation, as (role, content) turns, and where it came from (so later errors can point back at it).

    A plain-text record is the single turn ``("text", content)``.
    """

    messages: tuple[tuple[str, str], ...]
    source: str = ""
    line: int = 0

    @classmethod
    def pair(cls, prompt: str, response: str, source: str = "", line: int = 0) -> Record:
        return cls((("user", prompt), ("assistant", response)), source, line)

    @property
    def is_text(self) -> bool:
        return self.messages[0][0] == TEXT_ROLE

    def _last_assistant(self) -> int:
        return max((i for i, (role, _) in enumerate(self.messages) if role == "assistant"), default=-1)

    @property
    def response(self) -> str:
        """The last assistant turn (the whole text of a plain-text record)."""
        return self.messages[0][1] if self.is_text else self.messages[self._last_assistant()][1]

    @property
    def prompt(self) -> str:
        """The last user turn before the last assistant turn ("" for plain text)."""
        users = [c for role, c in self.messages[: self._last_assistant()] if role == "user"]
        return users[-1] if users and not self.is_text else ""

    def chat(self) -> list[dict[str, str]]:
        """The turns as chat-template messages."""
        return [{"role": role, "content": content} for role, content in self.messages]


@dataclass(frozen=True)
class FieldMap:
    """Which keys of a row hold the prompt, the optional extra input, and the response (metamath/custom)."""

    prompt: str = "query"
    response: str = "response"
    input: str | None = None

    @staticmethod
    def for_format(fmt: str, prompt: str = "query", response: str = "response", input: str | None = None) -> FieldMap:
        if fmt == "alpaca":
            return FieldMap("instruction", "output", "input")
        if fmt == "prompt_completion":
            return FieldMap("prompt", "completion")
        if fmt in FORMATS:
            return FieldMap(prompt, response, input)
        raise DataError(
            f"unknown data format {fmt!r}", f"Use one of {', '.join(map(repr, FORMATS))}", field="data_format"
        )


def _text(value: object, source: str, line: int, key: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise DataFormatError(source, line, key, f"non-finite number {value}", "Write the value as a string")
        return str(value)  # numeric answers are common in math sets; accept them as text
    if not isinstance(value, str):
        raise DataFormatError(
            source, line, key, f"expected a string, got {type(value).__name__}", "Make the value a string"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        # an unpaired \\ud800-\\udfff escape: valid JSON, but no tokenizer can encode it
        raise DataFormatError(
            source,
            line,
            key,
            f"lone surrogate {value[e.start]!r} at character {e.start}",
            "Fix the \\u escape (a surrogate needs its pair) or remove the row",
        ) from e
    return value


def _field(row: Mapping, key: str, source: str, line: int, required: bool = True) -> str:
    if key not in row or row[key] is None:
        if not required:
            return ""
        raise DataFormatError(source, line, key, f"missing (row has keys {sorted(row)})", _KEY_FIX)
    return _text(row[key], source, line, key)


def _pair(row: Mapping, f: FieldMap, source: str, line: int) -> Record:
    prompt = _field(row, f.prompt, source, line)
    if f.input:
        extra = _field(row, f.input, source, line, required=False)
        if extra.strip():
            prompt = f"{prompt}\n{extra}"
    response = _field(row, f.response, source, line)
    if not prompt.strip():
        raise DataFormatError(source, line, f.prompt, "empty prompt", "Fill it in or remove the row")
    if not response.strip():
        raise DataFormatError(
            source, line, f.response, "empty response (nothing to train on)", "Fill it in or remove the row"
        )
    return Record.pair(prompt, response, source, line)


def _turns(
    row: Mapping, key: str, role_key: str, text_key: str, roles: Mapping[str, str], source: str, line: int
) -> Record:
    turns = row.get(key)
    if not isinstance(turns, list) or not turns:
        got = "missing" if key not in row else f"a {type(turns).__name__}, not a non-empty list"
        raise DataFormatError(
            source,
            line,
            key,
            f"{got} (row has keys {sorted(row)})",
            f"Make {key!r} a list of {{{role_key!r}: ..., {text_key!r}: ...}} turns",
        )
    out = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, Mapping) or role_key not in turn or text_key not in turn:
            raise DataFormatError(
                source,
                line,
                where,
                f"a turn needs {role_key!r} and {text_key!r}",
                f"Write each turn as {{{role_key!r}: ..., {text_key!r}: ...}}",
            )
        role = roles.get(str(turn[role_key]).lower())
        if role is None:
            raise DataFormatError(
                source,
                line,
                f"{where}.{role_key}",
                f"unknown role {turn[role_key]!r}",
                f"Use one of {', '.join(map(repr, dict.fromkeys(roles)))}",
            )
        content = _text(turn[text_key] if turn[text_key] is not None else "", source, line, f"{where}.{text_key}")
        if role == "assistant" and not content.strip():
            raise DataFormatError(
                source,
                line,
                f"{where}.{text_key}",
                "empty assistant turn (nothing to train on)",
                "Fill it in or remove the turn",
            )
        out.append((role, content))
    if not any(role == "assistant" for role, _ in out):
        raise DataFormatError(
            source,
            line,
            key,
            "no assistant turn (nothing to train on)",
            "Add the assistant's reply, or use data_format: text to train on all tokens",
        )
    return Record(tuple(out), source, line)


def detect_format(row: object, fields: FieldMap) -> str:
    """The format a row's keys say (``metamath`` for ``prompt_key``/``response_key``)."""
    keys = row if isinstance(row, Mapping) else {}
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if fields.prompt not in keys and "instruction" in keys and "output" in keys:
        return "alpaca"
    if fields.prompt not in keys and "prompt" in keys and "completion" in keys:
        return "prompt_completion"
    if fields.prompt not in keys and "text" in keys:
        return "text"
    return "metamath"


def to_record(row: object, fmt: str, fields: FieldMap, source: str, line: int) -> Record:
    """``row`` of format ``fmt`` (not ``auto``) as a :class:`Record`."""
    if not isinstance(row, Mapping):
        raise DataFormatError(
            source,
            line,
            None,
            f"expected a JSON object, got {type(row).__name__}",
            'Make every row an object such as {"messages": [...]} or {"query": ..., "response": ...}',
        )
    if fmt == "messages":
        return _turns(row, "messages", "role", "content", {r: r for r in _ROLES}, source, line)
    if fmt == "sharegpt":
        return _turns(row, "conversations", "from", "value", _SHAREGPT_ROLES, source, line)
    if fmt == "text":
        text = _field(row, "text", source, line)
        if not text.strip():
            raise DataFormatError(
                source, line, "text", "empty text (nothing to train on)", "Fill it in or remove the row"
            )
        return Record(((TEXT_ROLE, text),), source, line)
    return _pair(row, FieldMap.for_format(fmt, fields.prompt, fields.response, fields.input), source, line)


def records_from_rows(rows: Iterable[tuple[str, int, object]], fields: FieldMap, fmt: str) -> list[Record]:
    """Rows of one format as records; ``auto`` takes the format from the first row."""
    records: list[Record] = []
    for source, line, row in rows:
        if fmt == "auto":
            fmt = detect_format(row, fields)
        records.append(to_record(row, fmt, fields, source, line))
    return records


def read_records(path: str | Path | DataSource, fields: FieldMap | None = None, fmt: str = "auto") -> list[Record]:
    """All records of a source: a data file, every data file of a folder in order, or a ``load_dataset`` name.

    Raises :class:`DataError` for any bad input (never returns an empty list).
    """
    source = path if isinstance(path, DataSource) else DataSource(str(path))
    records = records_from_rows(iter_rows(source), fields or FieldMap(), fmt)
    if not records:
        local = Path(source.path).expanduser()
        names = source.path if is_dataset_name(source.path) else ", ".join(map(str, data_files(local, source.split)))
        raise EmptyDataError(
            "no records (the data files are empty or hold only blank lines)",
            "Point data_path at the data, or check the download finished",
            source=names,
        )
    return records
