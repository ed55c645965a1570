"""Sources (jsonl / parquet / csv files, split folders, load_dataset) and the tokenized-set cache."""

import json

import datasets
import lightning.pytorch as pl
import pytest
import torch

from lightning_lazytrain.sft.data import DataPathError, DataSource, SFTDataModule, read_records
from lightning_lazytrain.sft.data.demo_chat import DEMO_CHAT_PATH
from lightning_lazytrain.sft.data.tokenizer import load_tokenizer
from lightning_lazytrain.sft.module import CausalLMModule

ROWS = [{"query": f"What is {i} + 1?", "response": f"The answer is: {i + 1}"} for i in range(6)]


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_parquet_and_csv_give_the_records_of_the_jsonl(tmp_path, suffix):
    table = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"d.{suffix}"
    table.to_parquet(str(path)) if suffix == "parquet" else table.to_csv(str(path), index=False)
    want = [(r.messages, r.line) for r in read_records(_jsonl(tmp_path / "d.jsonl", ROWS))]
    assert [(r.messages, r.line) for r in read_records(path)] == want
    chat = tmp_path / "chat.parquet"
    datasets.Dataset.from_json(str(DEMO_CHAT_PATH)).to_parquet(str(chat))
    assert [r.messages for r in read_records(chat)] == [r.messages for r in read_records(DEMO_CHAT_PATH)]


def test_a_split_folder_reads_only_the_asked_split(tmp_path):
    _jsonl(tmp_path / "data" / "train-00000-of-00001.jsonl", ROWS[:4])
    datasets.Dataset.from_list(ROWS[4:]).to_parquet(str(tmp_path / "data" / "test-00000-of-00001.parquet"))
    assert [r.prompt for r in read_records(DataSource(str(tmp_path)))] == [r["query"] for r in ROWS[:4]]
    assert [r.prompt for r in read_records(DataSource(str(tmp_path), split="test"))] == [r["query"] for r in ROWS[4:]]


def test_a_dataset_name_goes_to_load_dataset_with_split_revision_and_cache(tmp_path, monkeypatch):
    calls = []

    def fake_load_dataset(path, split, revision, cache_dir):
        calls.append((path, split, revision, cache_dir))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    records = read_records(DataSource("hf:meta-math/MetaMathQA", "train", "abc123", str(tmp_path)))
    assert calls == [("meta-math/MetaMathQA", "train", "abc123", str(tmp_path))]
    assert [(r.prompt, r.source, r.line) for r in records][:2] == [
        ("What is 0 + 1?", "meta-math/MetaMathQA[train]", 1),
        ("What is 1 + 1?", "meta-math/MetaMathQA[train]", 2),
    ]


def test_an_unknown_dataset_name_offline_is_a_data_path_error(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataPathError, match="hf:nobody-here/no-such-set: datasets.load_dataset failed.*data_split"):
        read_records("hf:nobody-here/no-such-set")
    with pytest.raises(DataPathError, match="does not exist.*hf:owner/name"):
        read_records("meta-math/MetaMathQA")  # without hf: a path, as in the recipes' data/MetaMathQA


def test_second_setup_reads_the_cache_and_calls_the_tokenizer_zero_times(tmp_path, tok, monkeypatch):
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    kw = dict(max_seq_length=64, val_fraction=0.5, cache_dir=str(tmp_path / "cache"))
    first = SFTDataModule(str(path), **kw)
    first.tokenizer = tok
    first.setup("fit")
    calls = []
    real = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    second = SFTDataModule(str(path), **kw)
    second.tokenizer = tok
    second.setup("fit")
    assert calls == [] and len(list((tmp_path / "cache").glob("*.pt"))) == 2
    for a, b in zip(
        first.train_set.examples + first.val_set.examples, second.train_set.examples + second.val_set.examples
    ):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.prompt_ids, b.prompt_ids) and a.answer == b.answer
    # a change of the data, the settings or the template is a miss
    for change in ("data", "max_seq_length", "template"):
        data = _jsonl(tmp_path / f"{change}.jsonl", ROWS if change != "data" else ROWS[::-1])
        other = SFTDataModule(str(data), **{**kw, "max_seq_length": 63 if change == "max_seq_length" else 64})
        other.tokenizer = load_tokenizer() if change == "template" else tok
        if change == "template":
            other.tokenizer.chat_template = other.tokenizer.chat_template.replace("\\n", "\\n\\n", 1)
        calls.clear()
        other.setup("fit")
        assert calls, f"a changed {change} must tokenize again"


def _fit(family, strategy, data_path, steps=2):
    shape = dict(
        model_type=family,
        vocab_size=151669,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    if family == "qwen3":
        shape["head_dim"] = 16
    torch.manual_seed(0)
    module = CausalLMModule(model_config=shape, lr=1e-3, max_generate_samples=0)
    losses = []
    module.on_train_batch_end = lambda out, batch, i: losses.append(float(out["loss"]))
    dm = SFTDataModule(data_path, max_seq_length=160, val_fraction=0.0, max_samples=8, batch_size=2, packing=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm)
    return losses


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sft_on_the_shipped_chat_set_trains_through_lazytrain_as_plain(family, tmp_path):
    chat = tmp_path / "chat.parquet"
    datasets.Dataset.from_json(str(DEMO_CHAT_PATH)).to_parquet(str(chat))
    plain = _fit(family, "auto", "demo_chat")
    streamed = _fit(family, "lazytrain", str(chat))  # the same rows from a parquet file
    assert len(plain) == 2 and streamed == pytest.approx(plain, rel=1e-5)
    assert abs(plain[0] - torch.log(torch.tensor(151669.0)).item()) < 1.0  # random init: near uniform
