import math

import lightning.pytorch as pl
import pytest
import torch

from lightning_lazytrain.sft.data import SFTCollator, SFTDataModule, tokenize_records
from lightning_lazytrain.sft.data.formats import Record
from lightning_lazytrain.sft.data.tokenizer import load_tokenizer
from lightning_lazytrain.sft.eval_prompts import new_token_count
from lightning_lazytrain.sft.module import CausalLMModule, build_model, warmup_cosine

TINY = dict(model_type="qwen2", vocab_size=151669, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_build_model_needs_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one"):
        build_model()
    with pytest.raises(ValueError, match="exactly one"):
        build_model("x", TINY)
    with pytest.raises(ValueError, match="model_type"):
        build_model(model_config={"hidden_size": 8})
    m = build_model(model_config=TINY, dtype="bfloat16")
    assert m.dtype == torch.bfloat16 and m.config.num_hidden_layers == 1


def test_training_loss_is_the_hf_loss(tok):
    torch.manual_seed(0)
    module = CausalLMModule(model_config=TINY)
    recs = [Record.pair("What is 1 + 1?", "The answer is: 2", "mem", 1)]
    examples, _ = tokenize_records(tok, recs, 64)
    batch = SFTCollator(tok.pad_token_id)(examples)
    got = module.training_step(batch, 0)
    ref = module.model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss
    assert torch.allclose(got, ref) and got.requires_grad


def test_warmup_cosine_shape():
    assert warmup_cosine(0, 10, 110, 0.0) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 110, 0.0) == pytest.approx(1.0)
    assert warmup_cosine(10, 10, 110, 0.0) == pytest.approx(1.0)
    assert warmup_cosine(60, 10, 110, 0.0) == pytest.approx(0.5)
    assert warmup_cosine(110, 10, 110, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(500, 0, 110, 0.2) == pytest.approx(0.2)


def test_optimizer_from_class_path_and_decay_groups():
    module = CausalLMModule(model_config=TINY, optimizer="torch.optim.Adam", lr=3e-4, weight_decay=0.1,
                            betas=(0.8, 0.9), eps=1e-6, warmup_steps=5)
    trainer = pl.Trainer(max_steps=50, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module.trainer = trainer
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert type(opt) is torch.optim.Adam
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-6
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-4 / 5)  # warm-up starts at 1/5
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == sum(p.numel() for p in module.model.parameters())
    for _ in range(4):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-4)


def _eval_batch(tok, n=4):
    recs = [Record.pair(f"What is {i} + 1?", f"{i} + 1 = {i + 1}. The answer is: {i + 1}", "mem", i) for i in range(n)]
    examples, _ = tokenize_records(tok, recs, 64)
    return SFTCollator(tok.pad_token_id, generation=True)(examples)


def test_exact_match_gathers_the_evaluations_prompts(tok):
    """Prompts of all validation batches (up to the cap) are decoded in one call at the evaluation's end."""
    module = CausalLMModule(model_config=TINY, max_new_tokens=8, max_generate_samples=6)
    module.tokenizer = tok
    batch = _eval_batch(tok)
    calls = []

    def fake_generate(input_ids, attention_mask, max_new_tokens, **kw):
        # the prompt "What is i + 1?" is answered i + 1, except i == 1; decoding starts after the left-padded prompt
        calls.append((input_ids.shape[0], max_new_tokens, kw["do_sample"]))
        assert bool(attention_mask[:, -1].all()), "prompts must be left-padded"
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            i = int(tok.decode(ids[mask.bool()]).split("What is ")[1].split(" ")[0])
            text = f"The answer is: {i + 1 if i != 1 else 99}<|im_end|>"
            rows.append(torch.cat([ids, torch.tensor(tok(text).input_ids)]))
        width = max(len(r) for r in rows)
        return torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=tok.pad_token_id) for r in rows])

    module.model.generate = fake_generate
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, (float(value), kw.get("batch_size")))
    module.on_validation_epoch_start()
    module.validation_step(batch, 0)
    module.validation_step(batch, 1)  # two of its rows fit under the cap of 6
    module.validation_step(batch, 2)  # the cap is per evaluation: none of these
    assert calls == []
    module.on_validation_epoch_end()
    assert calls == [(6, 8, False)]  # one greedy call for the evaluation
    assert logged["val/exact_match"] == (pytest.approx(4 / 6), 6)  # i = 0, 2, 3 and then 0 right; 1 twice wrong
    assert logged["val/generate_tokens_per_s"][0] > 0 and logged["val/generate_s"][0] > 0
    assert math.isfinite(logged["val/loss"][0]) and 0.0 <= logged["val/token_acc"][0] <= 1.0
    module.on_validation_epoch_end()
    assert len(calls) == 1


def test_generate_batch_size_splits_the_gathered_prompts(tok):
    module = CausalLMModule(model_config=TINY, max_new_tokens=2, max_generate_samples=None, generate_batch_size=3)
    module.tokenizer = tok
    sizes = []

    def fake_generate(input_ids, attention_mask, max_new_tokens, **kw):
        sizes.append(input_ids.shape[0])
        return torch.cat([input_ids, torch.full((input_ids.shape[0], 2), tok.pad_token_id)], 1)

    module.model.generate = fake_generate
    module.log = lambda *a, **kw: None
    module.on_validation_epoch_start()
    module.validation_step(_eval_batch(tok), 0)
    module.validation_step(_eval_batch(tok, 3), 1)
    module.on_validation_epoch_end()
    assert sizes == [3, 3, 1]


def test_new_token_count_stops_at_the_first_end_of_turn():
    eos = 7
    new = torch.tensor([[1, 2, eos, eos], [1, 2, 3, 4], [eos, eos, eos, eos]])
    assert new_token_count(new, eos) == 3 + 4 + 1
    assert new_token_count(new, None) == 12


def test_validate_with_real_generation(tok):
    torch.manual_seed(0)
    module = CausalLMModule(model_config=TINY, max_new_tokens=3, max_generate_samples=4)
    dm = SFTDataModule("demo", max_seq_length=64, batch_size=4, max_eval_samples=4)
    dm._tokenizer = tok
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    (metrics,) = trainer.validate(module, datamodule=dm)
    assert metrics["val/exact_match"] == 0.0  # an untrained model cannot answer
    assert metrics["val/loss"] > 5.0 and "val/token_acc" in metrics
    assert module.tokenizer is tok  # the datamodule's tokenizer is the one used for decoding


def test_vocab_smaller_than_tokenizer_is_refused(tok):
    module = CausalLMModule(model_config={**TINY, "vocab_size": 1000})
    module.tokenizer = tok
    module.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="vocab_size"):
        module.configure_model()  # the Trainer calls it before the strategy's setup
