import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_lazytrain.sft.data.tokenizer import load_tokenizer
from lightning_lazytrain.sft.export import HFExportCallback, export_hf
from lightning_lazytrain.sft.module import build_model

TINY = dict(model_type="qwen2", vocab_size=151669, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_round_trip_same_logits(tmp_path, tok):
    torch.manual_seed(0)
    model = build_model(model_config=TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # not the init distribution: a reload from scratch would differ
    out = export_hf(model, tmp_path / "hf", tokenizer=tok, dtype="float32")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary directory left behind
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tok("The answer is: 42").input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    again = AutoTokenizer.from_pretrained(out)
    assert again("Hello world").input_ids == [9707, 1879] and again.chat_template == tok.chat_template


def test_failed_export_leaves_previous_one_intact(tmp_path, monkeypatch):
    model = build_model(model_config=TINY)
    target = export_hf(model, tmp_path / "hf")
    before = (target / "config.json").read_text()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        export_hf(model, target)
    assert (target / "config.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    with pytest.raises(FileExistsError):
        export_hf(model, target, overwrite=False)


def test_callback_exports_at_fit_end(tmp_path, tok):
    import lightning.pytorch as pl

    from lightning_lazytrain.sft.data.sft import SFTDataModule
    from lightning_lazytrain.sft.module import CausalLMModule

    module = CausalLMModule(model_config=TINY, max_generate_samples=0)
    dm = SFTDataModule("demo", max_seq_length=64, batch_size=2, max_eval_samples=2)
    dm._tokenizer = tok
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[HFExportCallback(str(tmp_path / "out"))])
    trainer.fit(module, datamodule=dm)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    trained = dict(module.model.named_parameters())
    assert next(module.model.parameters()).dtype == torch.float32  # the masters stay fp32; the export is bf16
    exported = dict(loaded.named_parameters())
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, trained[n].bfloat16()) for n, p in exported.items())
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("tied", [False, True])
def test_export_writes_bf16_by_default(tmp_path, tied):
    torch.manual_seed(0)
    model = build_model(model_config={**TINY, "tie_word_embeddings": tied})
    fp32 = export_hf(model, tmp_path / "fp32", dtype=torch.float32)
    out = export_hf(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert ("lm_head.weight" in f.keys()) is not tied  # a tied head is still written once
    size = (out / "model.safetensors").stat().st_size
    assert abs(size / (fp32 / "model.safetensors").stat().st_size - 0.5) < 0.01
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    want = {n: p.detach().bfloat16() for n, p in model.named_parameters()}
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, want[n]) for n, p in loaded.named_parameters())
    assert next(model.parameters()).dtype == torch.float32  # the model itself is not cast
    with pytest.raises(ValueError, match="not a floating torch dtype"):
        export_hf(model, tmp_path / "bad", dtype="int8")
