import json
import warnings

import pytest
import torch

from lightning_lazytrain.sft.data import (
    IGNORE_INDEX,
    DataFormatError,
    SFTCollator,
    SFTDataModule,
    pack_examples,
    read_records,
    split_indices,
    tokenize_records,
)
from lightning_lazytrain.sft.data.demo_math import DEMO_MATH_PATH, generate_demo_math
from lightning_lazytrain.sft.data.formats import FieldMap
from lightning_lazytrain.sft.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_label_mask_covers_exactly_the_response(tok, tmp_path):
    f = _write_jsonl(tmp_path / "d.jsonl", [{"query": "What is 3 + 4?", "response": "3 + 4 = 7. The answer is: 7"}])
    (ex,), skipped = tokenize_records(tok, read_records(f), max_seq_length=256)
    assert skipped == 0
    prompt = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    n_prompt = len(tok(prompt).input_ids)
    assert ex.prompt_ids.tolist() == tok(prompt).input_ids
    assert ex.labels[:n_prompt].tolist() == [IGNORE_INDEX] * n_prompt
    assert (ex.labels[n_prompt:] != IGNORE_INDEX).all()
    assert tok.decode(ex.labels[n_prompt:].tolist()) == "3 + 4 = 7. The answer is: 7<|im_end|>\n"
    assert tok.decode(ex.input_ids.tolist()) == prompt + "3 + 4 = 7. The answer is: 7<|im_end|>\n"
    assert ex.answer == "7"


def test_truncation_keeps_labels_or_skips_and_counts(tok, tmp_path):
    rows = [{"query": "Hi", "response": "word " * 50}, {"query": "long " * 80, "response": "x"}]
    records = read_records(_write_jsonl(tmp_path / "d.jsonl", rows))
    examples, skipped = tokenize_records(tok, records, max_seq_length=20)
    assert skipped == 1 and len(examples) == 1
    assert len(examples[0].input_ids) == 20 and (examples[0].labels != IGNORE_INDEX).any()


def test_datamodule_warns_on_skipped(tmp_path):
    rows = [{"query": f"q{i}", "response": "r"} for i in range(10)] + [{"query": "long " * 200, "response": "r"}]
    dm = SFTDataModule(str(_write_jsonl(tmp_path / "d.jsonl", rows)), max_seq_length=32, val_fraction=0.2)
    with pytest.warns(UserWarning, match="skipped 1 of 11"):
        dm.setup("fit")
    assert dm.skipped == 1 and len(dm.train_set) + len(dm.val_set) == 10


def test_split_is_deterministic_disjoint_and_complete():
    train, val = split_indices(100, 0.3, seed=42)
    assert len(val) == 30 and len(train) == 70
    assert sorted(train + val) == list(range(100))
    assert split_indices(100, 0.3, seed=42) == (train, val)
    assert split_indices(100, 0.3, seed=7)[1] != val
    assert len(split_indices(3, 0.01, 0)[1]) == 1  # a requested split is never empty
    with pytest.raises(ValueError):
        split_indices(10, 1.0, 0)


@pytest.mark.parametrize(
    ("line", "field", "match"),
    [
        ('{"query": "q"}', "response", "missing"),
        ('{"query": ["q"], "response": "r"}', "query", "expected a string"),
        ('{"query": "q", "response": "r"', None, "invalid JSON"),
        ('["q", "r"]', None, "expected a JSON object"),
    ],
)
def test_bad_row_names_file_line_and_field(tmp_path, line, field, match):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"query": "a", "response": "b"}\n\n' + line + "\n")
    with pytest.raises(DataFormatError, match=match) as info:
        read_records(f)
    err = info.value
    assert isinstance(err, ValueError) and err.line == 3 and err.field == field
    assert f"{f}:3" in str(err) and (field is None or repr(field) in str(err))


def test_alpaca_json_array_and_custom_fields(tmp_path):
    f = tmp_path / "a.json"
    f.write_text(json.dumps([{"instruction": "Add", "input": "2 and 3", "output": "5"},
                             {"instruction": "Say hi", "input": "", "output": "hi"}]))
    recs = read_records(f)  # auto-detected
    assert [(r.prompt, r.response, r.line) for r in recs] == [("Add\n2 and 3", "5", 1), ("Say hi", "hi", 2)]
    g = _write_jsonl(tmp_path / "c.jsonl", [{"question": "Q?", "answer": 4}])
    (r,) = read_records(g, FieldMap.for_format("custom", prompt="question", response="answer"))
    assert (r.prompt, r.response) == ("Q?", "4")


def test_local_hub_dataset_directory(tmp_path):
    (tmp_path / "data").mkdir()
    _write_jsonl(tmp_path / "data" / "train-00001.jsonl", [{"query": "b", "response": "2"}])
    _write_jsonl(tmp_path / "data" / "train-00000.jsonl", [{"query": "a", "response": "1"}])
    (tmp_path / "dataset_info.json").write_text("{}")
    (tmp_path / "README.md").write_text("# card")
    assert [r.prompt for r in read_records(tmp_path)] == ["a", "b"]
    with pytest.raises(FileNotFoundError):
        read_records(tmp_path / "nope")


def test_collate_pads_right_and_generation_prompts_left(tok):
    from lightning_lazytrain.sft.data import Example

    a = Example([1, 2, 3], [IGNORE_INDEX, 2, 3], [1], "x")
    b = Example([4, 5], [IGNORE_INDEX, 5], [4, 9, 9], "y")
    out = SFTCollator(pad_id=0, generation=True)([a, b])
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert out["labels"].tolist() == [[IGNORE_INDEX, 2, 3], [IGNORE_INDEX, 5, IGNORE_INDEX]]
    assert out["gen_input_ids"].tolist() == [[0, 0, 1], [4, 9, 9]]
    assert out["gen_attention_mask"].tolist() == [[0, 0, 1], [1, 1, 1]]
    assert out["answers"] == ["x", "y"]
    assert SFTCollator(0, pad_to_multiple_of=8)([a])["input_ids"].shape == (1, 8)


def test_packing_never_splits_a_sample():
    from lightning_lazytrain.sft.data import Example

    exs = [Example([i] * n, [IGNORE_INDEX] + [i] * (n - 1), [], None) for i, n in enumerate([3, 4, 2, 5])]
    packed = pack_examples(exs, 7)
    assert [len(p.input_ids) for p in packed] == [7, 7]
    assert [t for p in packed for t in p.input_ids.tolist()] == [t for e in exs for t in e.input_ids]
    assert [t for p in packed for t in p.labels.tolist()] == [t for e in exs for t in e.labels]


def test_demo_datamodule_end_to_end():
    dm = SFTDataModule("demo", max_seq_length=64, batch_size=4, max_eval_samples=8)
    dm.setup("fit")
    assert len(dm.train_set) == 2100 and len(dm.val_set) == 8
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4 and batch["labels"].dtype == torch.long
    assert (batch["labels"] != IGNORE_INDEX).any(dim=1).all()
    val = next(iter(dm.val_dataloader()))
    assert val["gen_input_ids"][:, -1].eq(198).all()  # every prompt ends with "assistant\n" (left padding)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.setup("validate")  # idempotent, no second tokenization warning


def test_demo_generator_is_deterministic_and_shipped_file_matches():
    rows = generate_demo_math()
    assert rows == generate_demo_math() and rows != generate_demo_math(seed=1)
    shipped = [json.loads(line) for line in DEMO_MATH_PATH.read_text().splitlines()]
    assert shipped == rows
    assert all(r["response"].endswith(f"The answer is: {eval(r['response'].split(' =')[0])}") for r in rows)
