"""Bad input to the SFT data module: any file gives records or one DataError naming file, line, field and fix."""

import json
import math
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lightning_lazytrain.sft.data import (
    IGNORE_INDEX,
    DataError,
    DataFormatError,
    DataPathError,
    DataSettingError,
    EmptyDataError,
    Record,
    SFTDataModule,
    read_records,
)
from lightning_lazytrain.sft.data.template import generation_prompt
from lightning_lazytrain.sft.data.tokenizer import load_tokenizer

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
GOOD_ROW = b'{"query": "What is 1 + 1?", "response": "2"}'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# -- arbitrary bytes: records or a DataError, never another exception ------------------------------------------------

_fragments = st.one_of(
    st.just(GOOD_ROW), st.just(b""), st.just(b"   "), st.just(b"\xef\xbb\xbf" + GOOD_ROW), st.just(b"\xff\xfe"),
    st.just(b'{"query": "a\\ud800", "response": "b"}'), st.just(b"[" * 5000 + b"]" * 5000),
    st.just(b'{"query": "q", "response": ' + b"9" * 5000 + b"}"), st.just(b'{"query": "q", "response": NaN}'),
    st.binary(max_size=30), st.text(max_size=30).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


@FUZZ
@given(lines=st.lists(_fragments, max_size=8), suffix=st.sampled_from([".jsonl", ".json"]))
def test_any_bytes_give_records_or_one_data_error(tmp_path, lines, suffix):
    data = b"\n".join(lines)
    path = _write(tmp_path, f"fuzz{suffix}", data)
    try:
        records = read_records(path)
    except DataError as err:
        assert str(path) in str(err)
        assert err.fix and str(err).endswith(err.fix)
        if isinstance(err, DataFormatError):
            assert 1 <= err.line <= max(1, data.count(b"\n") + 1) or suffix == ".json"  # arrays: record index
            assert f"{path}:{err.line}" in str(err)
        return
    assert records, "read_records never returns an empty list"
    for r in records:
        assert r.prompt.strip() and r.response.strip()
        assert r.prompt.encode("utf-8") and r.response.encode("utf-8")  # no lone surrogate: tokenizable


# -- JSON rows against an independent oracle of what is valid --------------------------------------------------------

_values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2), st.just(""), st.just("  \n"),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_rows = st.one_of(
    st.dictionaries(st.sampled_from(["query", "response", "other"]), _values, max_size=3),
    st.fixed_dictionaries({"query": st.text(min_size=1, max_size=8), "response": st.text(min_size=1, max_size=8)}),
    st.integers(), st.lists(st.text(max_size=3), max_size=2), st.text(max_size=5), st.none(),
)


def _field_problem(row: dict, key: str) -> str | None:
    """The oracle: why ``row[key]`` cannot be a prompt/response text, or None when it can."""
    value = row.get(key)
    if value is None:
        return "missing"
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return "expected a string"
    if isinstance(value, float) and not math.isfinite(value):
        return "non-finite number"
    text = str(value)
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        return "lone surrogate"
    if not text.strip():
        return "empty"
    return None


def _expected_failure(row: object) -> tuple[str | None, str] | None:
    if not isinstance(row, dict):
        return None, "expected a JSON object"
    for key in ("query", "response"):
        problem = _field_problem(row, key)
        # an empty value is only reported once both fields have been read as text
        if problem and problem != "empty":
            return key, problem
    for key in ("query", "response"):
        if _field_problem(row, key) == "empty":
            return key, "empty"
    return None


@FUZZ
@given(rows=st.lists(_rows, min_size=1, max_size=6), blanks=st.lists(st.booleans(), min_size=6, max_size=6),
       bom=st.booleans())
@example(rows=[{"query": "\ud800\udc00"}], blanks=[False] * 6, bom=False)  # a pair, once written: valid text
def test_json_rows_match_an_oracle(tmp_path, rows, blanks, bom):
    lines, numbers = [], []
    for row, blank in zip(rows, blanks):
        if blank:
            lines.append("")
        lines.append(json.dumps(row))  # ASCII with \\u escapes, NaN/Infinity as Python writes them
        numbers.append(len(lines))
    path = _write(tmp_path, "rows.jsonl", (b"\xef\xbb\xbf" if bom else b"") + "\n".join(lines).encode())
    # the oracle judges each row as a JSON reader gets it back: a high and a low surrogate written side by side
    # as escapes read back as one valid character
    rows = [json.loads(json.dumps(row)) for row in rows]
    failures = [(n, f) for n, row in zip(numbers, rows) if (f := _expected_failure(row))]
    if not failures:
        records = read_records(path)
        assert [(r.prompt, r.response, r.line) for r in records] == [
            (str(row["query"]), str(row["response"]), n) for n, row in zip(numbers, rows)]
        return
    line, (field, problem) = failures[0]
    with pytest.raises(DataFormatError) as info:
        read_records(path)
    err = info.value
    assert (err.line, err.field) == (line, field), str(err)
    assert problem in err.problem and f"{path}:{line}" in str(err)
    assert field is None or f"field {field!r}" in str(err)


# -- each kind of bad input, with the words of its message -----------------------------------------------------------

@pytest.mark.parametrize(
    ("name", "data", "line", "field", "words"),
    [
        ("latin1.jsonl", GOOD_ROW + b'\n{"query": "caf\xe9", "response": "b"}\n', 2, None, ["not UTF-8", "iconv"]),
        ("surrogate.jsonl", b'{"query": "a\\udc00b", "response": "b"}', 1, "query", ["lone surrogate", "pair"]),
        ("deep.jsonl", GOOD_ROW + b"\n" + b"[" * 100_000 + b"]" * 100_000, 2, None, ["nested too deeply"]),
        ("hugeint.jsonl", b'{"query": "q", "response": ' + b"7" * 5000 + b"}", 1, None, ["too many digits", "string"]),
        ("inf.jsonl", b'{"query": "q", "response": Infinity}', 1, "response", ["non-finite", "string"]),
        ("bool.jsonl", b'{"query": true, "response": "r"}', 1, "query", ["expected a string, got bool"]),
        ("missing.jsonl", b'{"question": "q", "response": "r"}', 1, "query", ["missing", "question", "prompt_key"]),
        ("emptyprompt.jsonl", b'{"query": " ", "response": "r"}', 1, "query", ["empty prompt", "remove the row"]),
        ("emptyresp.jsonl", b'{"query": "q", "response": ""}', 1, "response", ["empty response", "Fill it in"]),
        ("lines.json", GOOD_ROW + b"\n" + GOOD_ROW + b"\n", 2, None, ["Extra data", "rename it to .jsonl"]),
        ("scalar.json", b"42", 1, None, ["expected a JSON array", "array of objects"]),
        ("broken.json", b'[\n{"query": "q",\n "response": }\n]', 3, None, ["invalid JSON", "array of objects"]),
    ],
)
def test_each_bad_input_names_file_line_field_and_fix(tmp_path, name, data, line, field, words):
    path = _write(tmp_path, name, data)
    with pytest.raises(DataFormatError) as info:
        read_records(path)
    err = info.value
    assert isinstance(err, DataError) and isinstance(err, ValueError)
    assert (err.line, err.field) == (line, field)
    assert str(err).startswith(f"{path}:{line}")
    for word in words:
        assert word in str(err)


def test_bom_crlf_and_blank_lines_are_accepted(tmp_path):
    path = _write(tmp_path, "win.jsonl", b"\xef\xbb\xbf" + GOOD_ROW + b"\r\n\r\n   \n" + GOOD_ROW + b"\r\n")
    assert [r.line for r in read_records(path)] == [1, 4]
    array = _write(tmp_path, "win.json", b"\xef\xbb\xbf[" + GOOD_ROW + b"]")
    assert read_records(array)[0].response == "2"


@pytest.mark.parametrize("data", [b"", b"\n\n  \n", b"[]", b'{"train": []}'])
def test_a_file_without_rows_is_refused(tmp_path, data):
    path = _write(tmp_path, "empty.json" if data.startswith((b"[", b"{")) else "empty.jsonl", data)
    with pytest.raises(EmptyDataError, match=f"{path}: no records.*data_path"):
        read_records(path)


def test_bad_paths_are_data_path_errors_that_say_what_to_do(tmp_path):
    with pytest.raises(DataPathError, match="does not exist. Fix data_path") as info:
        read_records(tmp_path / "nope.jsonl")
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(DataPathError, match=r"unsupported data file type '\.txt'.*\.jsonl.*\.parquet"):
        read_records(_write(tmp_path, "d.txt", b"q,r\n"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataPathError, match=r"no data files \(.jsonl, .json, .parquet, .csv\)"):
        read_records(tmp_path / "empty_dir")


# -- prompts longer than max_seq_length: dropped and counted, and an empty result is refused -------------------------

def _datamodule(tmp_path, tok, rows, **kw):
    path = _write(tmp_path, "d.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    dm = SFTDataModule(str(path), **kw)
    dm._tokenizer = tok  # one tokenizer for all examples: building it takes seconds
    return dm, path


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=8),
       max_seq=st.integers(min_value=2, max_value=40), val=st.sampled_from([0.0, 0.5]))
def test_long_prompts_are_dropped_and_counted_or_the_set_is_refused(tmp_path, tok, words, max_seq, val):
    rows = [{"query": "word " * n + "end", "response": f"answer {i}"} for i, n in enumerate(words)]
    dm, path = _datamodule(tmp_path, tok, rows, max_seq_length=max_seq, val_fraction=val, max_eval_samples=None)
    prompts = [generation_prompt(tok, Record.pair(r["query"], r["response"]).chat()) for r in rows]
    too_long = [len(tok(p, add_special_tokens=False).input_ids) >= max_seq for p in prompts]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dm.setup("fit")
    except EmptyDataError as err:
        assert str(path) in str(err) and "max_seq_length" in str(err) and err.fix
        assert not dm.train_set
        return
    assert dm.skipped == sum(too_long)
    assert len(dm.train_set) + len(dm.val_set) == len(rows) - sum(too_long)
    assert (dm.skipped > 0) == any(f"skipped {dm.skipped} of {len(rows)}" in str(w.message) for w in caught)
    assert len(dm.train_set) > 0 and (val == 0 or len(dm.val_set) > 0)
    for ex in dm.train_set.examples + dm.val_set.examples:
        assert len(ex.input_ids) <= max_seq and (ex.labels != IGNORE_INDEX).any()


def test_every_prompt_too_long_raises_naming_the_setting(tmp_path, tok):
    dm, path = _datamodule(tmp_path, tok, [{"query": "long " * 50, "response": "r"}] * 4, max_seq_length=16,
                           val_fraction=0.0)
    with pytest.raises(EmptyDataError, match=f"{path}: no training sample left: all 4 .*max_seq_length=16.*Raise"):
        dm.setup("fit")


def test_no_held_out_sample_raises_when_a_split_was_asked_for(tmp_path, tok):
    dm, path = _datamodule(tmp_path, tok, [{"query": "q", "response": "r"}], val_fraction=0.3)
    with pytest.raises(EmptyDataError, match=f"{path}: no held-out sample.*val_fraction=0"):
        dm.setup("fit")
    dm, _ = _datamodule(tmp_path, tok, [{"query": "q", "response": "r"}], val_fraction=0.0)
    dm.setup("fit")
    assert len(dm.train_set) == 1 and len(dm.val_set) == 0


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"max_seq_length": 0}, "max_seq_length"), ({"batch_size": 0}, "batch_size"), ({"val_fraction": 1.0},
     "val_fraction"), ({"val_fraction": -0.1}, "val_fraction"), ({"max_samples": 0}, "max_samples"),
     ({"num_workers": -1}, "num_workers"), ({"data_format": "csv"}, "data_format"),
     ({"eval_batch_size": 2.5}, "eval_batch_size")],
)
def test_out_of_range_settings_name_the_argument(kw, field):
    with pytest.raises(DataError) as info:
        SFTDataModule("demo", **kw)
    assert info.value.field == field and str(info.value).startswith(field) and "Use " in str(info.value)
    assert isinstance(info.value, DataSettingError) or field == "data_format"
