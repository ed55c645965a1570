"""Evaluation-time generation under lazytrain against plain HF ``generate`` and plain Lightning training."""

import copy
import dataclasses
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import VOCAB, LMModule, batches, loader, rel_diff, tiny_model

import lightning_lazytrain.engine.generation.generate as generation
from lightning_lazytrain import LazyTrainStrategy

GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


def _prompts(n: int = 5, seq: int = 7, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of different widths
    mask[2, :1] = 0
    ids[mask == 0] = 0
    return ids, mask


class _Generate(LMModule):
    def __init__(self, model, mask, **generate_kw):
        super().__init__(model)
        self.mask, self.plans, self.generate_kw = mask, [], generate_kw or GREEDY

    def predict_step(self, batch, batch_idx):
        out = self.model.generate(batch, attention_mask=self.mask, **self.generate_kw)
        self.plans.append(self.trainer.strategy.generation.last_plan)
        return out


def _lazytrain_generate(model, ids, mask, mode):
    module = _Generate(copy.deepcopy(model), mask)
    trainer = pl.Trainer(accelerator="cpu", strategy=LazyTrainStrategy(generation=mode), logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    (out,) = trainer.predict(module, loader([ids]))
    return out, module.plans[0]


@pytest.mark.parametrize("mode", ["resident", "streamed"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3.5"])
def test_greedy_tokens_equal_plain_hf_generate(family, mode):
    model = tiny_model(family)
    ids, mask = _prompts()
    expected = copy.deepcopy(model).generate(ids, attention_mask=mask, **GREEDY)
    out, plan = _lazytrain_generate(model, ids, mask, mode)
    assert plan.mode == mode and plan.forced and plan.batch_size == 5
    assert out.shape == expected.shape and torch.equal(out, expected)


@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_prompts_split_into_batches_give_the_whole_batch_tokens(mode, monkeypatch):
    """A batch larger than the memory allows is decoded in slices; the outputs are padded and joined as one
    ``generate`` over the whole batch returns them (a row that stops early is padded to the longest)."""
    real = generation.plan_generation
    monkeypatch.setattr(generation, "plan_generation",
                        lambda *a, **kw: dataclasses.replace(real(*a, **kw), batch_size=2))
    model = tiny_model("qwen2")
    ids, mask = _prompts()
    eos = int(copy.deepcopy(model).generate(ids, attention_mask=mask, **GREEDY)[1, -3])  # row 1 stops early
    kw = dict(GREEDY, eos_token_id=eos)
    expected = copy.deepcopy(model).generate(ids, attention_mask=mask, **kw)
    module = _Generate(copy.deepcopy(model), mask, **kw)
    trainer = pl.Trainer(accelerator="cpu", strategy=LazyTrainStrategy(generation=mode), logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    (out,) = trainer.predict(module, loader([ids]))
    assert [p.batches for p in module.plans] == [3]
    assert trainer.strategy.generation is None  # teardown gave the model its own generate back
    assert "generate" not in module.model.__dict__
    assert (expected[1, -2:] == 0).all(), "row 1 must have stopped early (padded)"
    assert torch.equal(out, expected)


class _ValidateWithGeneration(LMModule):
    """Validation generates greedily; records whether the resident copies exist while it runs."""

    def __init__(self, model, prompts, mask):
        super().__init__(model)
        self.prompts, self.mask = prompts, mask
        self.generated, self.resident_during_eval = [], []

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.generated.append(self.model.generate(self.prompts, attention_mask=self.mask, **GREEDY).cpu())
        generation_control = getattr(self.trainer.strategy, "generation", None)
        if generation_control is not None:
            self.resident_during_eval.append(generation_control.resident is not None)


class _ResidentProbe(pl.Callback):
    def __init__(self):
        self.resident_in_training = []

    def on_train_batch_start(self, trainer, *args):
        self.resident_in_training.append(trainer.strategy.generation.resident is not None)


@pytest.mark.parametrize("mode", ["auto", "streamed"])
def test_training_after_evaluation_matches_plain_lightning(mode):
    model, data = tiny_model("qwen3.5"), batches(3, padded=True)
    val, (prompts, mask) = batches(2, seed=7, padded=True), _prompts()
    runs = {}
    for name, strategy in (("plain", "auto"), ("lazytrain", LazyTrainStrategy(generation=mode))):
        module = _ValidateWithGeneration(copy.deepcopy(model), prompts, mask)
        probe = _ResidentProbe()
        trainer = pl.Trainer(accelerator="cpu", strategy=strategy, max_steps=3, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=1, val_check_interval=1, limit_val_batches=1,
                             check_val_every_n_epoch=None, callbacks=[probe] if name == "lazytrain" else [])
        trainer.fit(module, loader(data), loader(val))
        runs[name] = (module, probe)
    (plain, _), (lazy, probe) = runs["plain"], runs["lazytrain"]
    assert rel_diff(plain.model, model) > 1e-3, "training must have moved the weights"
    assert rel_diff(lazy.model, plain.model) <= 1e-5
    assert lazy.val_losses == pytest.approx(plain.val_losses, rel=1e-5)
    assert len(lazy.generated) == len(plain.generated) == 1 + 3  # sanity check, then after each step
    assert all(torch.equal(a, b) for a, b in zip(lazy.generated, plain.generated))
    assert not torch.equal(lazy.generated[0], lazy.generated[-1]), "the evaluations must see the trained weights"
    # auto picks resident on the host's memory: loaded for each evaluation, dropped before each training batch
    assert lazy.resident_during_eval == [mode == "auto"] * 4
    assert probe.resident_in_training == [False] * 3


def test_generation_mode_is_checked():
    with pytest.raises(ValueError, match="generation must be one of"):
        LazyTrainStrategy(generation="fast")


def test_hf_device_mismatch_warning_is_not_raised_through_the_strategy(monkeypatch):
    """HF warns when the inputs' device type differs from ``model.device``; under lazytrain the weights live on the
    host by design while the layers run on the executor's device, so the warning would be wrong at every
    evaluation. On the CPU the devices agree, so HF's generate is made to warn as it does on a GPU."""
    model = tiny_model("qwen2")
    real = type(model).generate
    message = ("You are calling .generate() with the `input_ids` being on a device type different than your"
               " model's device.")

    def warning_generate(self, *args, **kwargs):
        warnings.warn(message, UserWarning, stacklevel=2)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", warning_generate)
    ids, mask = _prompts()
    with pytest.warns(UserWarning, match="being on a device type different"):
        copy.deepcopy(model).generate(ids, attention_mask=mask, **GREEDY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = _lazytrain_generate(model, ids, mask, "resident")
    assert not [w for w in caught if "being on a device type different" in str(w.message)]
    assert torch.equal(out, copy.deepcopy(model).generate(ids, attention_mask=mask, **GREEDY))
