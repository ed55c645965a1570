"""lazytrain on the CPU against a plain Lightning run from the same weights and data."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from helpers import FAMILIES, GradRecorder, LMModule, batches, loader, rel_diff, tiny_model, train, update_rel_diff

import lightning_lazytrain  # noqa: F401  (registers the strategy name)
from lightning_lazytrain import LazyTrainStrategy


@pytest.mark.parametrize("family", FAMILIES)
def test_three_steps_match_plain_training_fp32(family):
    """Weights that a rounding-level gradient moved by a rounding-picked +-lr are left out (``undecided``)."""
    model, data, recorder = tiny_model(family), batches(3), GradRecorder()
    ref, _ = train(model, data, callbacks=[recorder])
    lt, _ = train(model, data, strategy="lazytrain")
    skip = recorder.undecided()
    assert rel_diff(ref.model, model) > 1e-3, "the reference run must have moved the weights"
    assert sum(int(m.sum()) for m in skip.values()) <= 0.01 * sum(p.numel() for p in model.parameters())
    assert rel_diff(lt.model, ref.model, skip) <= 1e-5
    assert update_rel_diff(model, lt.model, ref.model, skip) <= 1e-4
    assert lt.losses == pytest.approx(ref.losses, rel=1e-6)


def test_rounding_noise_floor_of_qwen35_is_undecided_elements():
    """The measured noise floor: the plain Qwen3.5 run against itself with its start weights moved by one ulp
    differs by ~7e-5 (one embedding element's Adam step flips sign), by < 1e-6 once ``undecided`` is left out."""
    model, data, recorder = tiny_model("qwen3.5"), batches(3), GradRecorder()
    ref, _ = train(model, data, callbacks=[recorder])
    nudged = copy.deepcopy(model)
    signs = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in nudged.parameters():
            p.mul_(1 + 1.2e-7 * torch.randn(p.shape, generator=signs).sign())
    other, _ = train(nudged, data)
    assert rel_diff(other.model, ref.model) > 1e-5
    assert rel_diff(other.model, ref.model, recorder.undecided()) <= 2e-6


@pytest.mark.parametrize(
    "strategy",
    [
        LazyTrainStrategy(schedule="interval:2"),
        LazyTrainStrategy(schedule="interval:3", keep_graph_layers=1),
        LazyTrainStrategy(keep_graph_layers=4, num_slots=6),
    ],
    ids=["interval2", "interval3+graph1", "all-graphs"],
)
def test_recompute_and_graph_plans_match_plain(strategy):
    model, data = tiny_model("qwen2"), batches(3, padded=True)
    ref, _ = train(model, data)
    lt, _ = train(model, data, strategy=strategy)
    assert rel_diff(lt.model, ref.model) <= 1e-5


class _CopyCounter(pl.Callback):
    def __init__(self):
        self.copies = []

    def on_train_batch_end(self, trainer, *args):
        self.copies.append(trainer.strategy.last_step_stats["layer_h2d_copies"])


@pytest.mark.parametrize("schedule", ["interval:1", "interval:2", "interval:4"])
def test_weights_copied_at_most_twice_per_step(schedule):
    counter = _CopyCounter()
    train(tiny_model("qwen2"), batches(3), strategy=LazyTrainStrategy(schedule=schedule), callbacks=[counter])
    assert len(counter.copies) == 3
    assert all(4 <= c <= 2 * 4 for c in counter.copies), counter.copies


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_close_to_plain_within_bf16_noise(precision):
    """bf16 runs cannot agree to fp32 rounding: the plain run keeps fp32 weights inside autocast (norm weights
    multiply in fp32) while lazytrain streams bf16 weights. The tolerance is the bf16 noise floor itself: the
    distance between the plain bf16 run and the plain fp32 run, with a factor 2 of headroom."""
    model, data = tiny_model("qwen2"), batches(3)
    ref32, _ = train(model, data)
    ref16, _ = train(model, data, precision=precision)
    lt16, _ = train(model, data, strategy="lazytrain", precision=precision)
    noise = update_rel_diff(model, ref16.model, ref32.model)
    assert 0 < noise < 0.5
    assert update_rel_diff(model, lt16.model, ref16.model) <= 2 * noise
    assert lt16.losses == pytest.approx(ref16.losses, rel=2e-2)


def test_manual_optimization_with_clipping():
    model, data = tiny_model("qwen3"), batches(3)
    ref, _ = train(model, data, manual=True, clip=0.05)
    lt, _ = train(model, data, strategy="lazytrain", manual=True, clip=0.05)
    unclipped, _ = train(model, data, manual=True)
    assert rel_diff(unclipped.model, ref.model) > 1e-4, "clipping must change this run"
    assert rel_diff(lt.model, ref.model) <= 1e-5


def test_gradient_clip_val_and_accumulation():
    model, data = tiny_model("qwen2"), batches(6)
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    ref, _ = train(model, data, **kw)
    lt, _ = train(model, data, strategy="lazytrain", **kw)
    one_batch, _ = train(model, data, gradient_clip_val=0.05)
    assert rel_diff(one_batch.model, ref.model) > 1e-4, "accumulation must change this run"
    assert rel_diff(lt.model, ref.model) <= 1e-5


def test_validation_loop_matches():
    model, data = tiny_model("qwen3.5"), batches(3, padded=True)
    val = batches(2, seed=7, padded=True)
    common = dict(val_check_interval=1, limit_val_batches=2, check_val_every_n_epoch=None)
    ref = LMModule(copy.deepcopy(model))
    lt = LMModule(copy.deepcopy(model))
    for module, strategy in ((ref, "auto"), (lt, "lazytrain")):
        trainer = pl.Trainer(accelerator="cpu", strategy=strategy, max_steps=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=1, **common)
        trainer.fit(module, loader(data), loader(val))
    assert len(lt.val_losses) == len(ref.val_losses) == 1 + 2 * 2  # sanity batch, then 2 batches per step
    assert lt.val_losses == pytest.approx(ref.val_losses, rel=1e-5)


def test_two_steps_resume_two_steps_equals_four(tmp_path):
    """Four steps with a checkpoint after step 2; resuming from it and running steps 3-4 gives the same weights."""
    model, data = tiny_model("qwen2"), batches(2)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    straight, _ = train(model, data, strategy="lazytrain", max_steps=4, callbacks=[saver], enable_checkpointing=True)
    ckpt = tmp_path / "epoch=0-step=2.ckpt"
    assert ckpt.exists(), sorted(p.name for p in tmp_path.iterdir())
    resumed = LMModule(copy.deepcopy(model))
    trainer = pl.Trainer(accelerator="cpu", strategy="lazytrain", max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(resumed, loader(data), ckpt_path=ckpt)
    assert rel_diff(resumed.model, model) > 1e-3
    assert resumed.losses == straight.losses[2:]
    assert rel_diff(resumed.model, straight.model) == 0.0


def test_generate_through_streamed_layers_matches_plain():
    model = tiny_model("qwen3")
    prompt = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(3))
    expected = copy.deepcopy(model).generate(prompt, max_new_tokens=5, do_sample=False)

    class Predict(LMModule):
        def predict_step(self, batch, batch_idx):
            return self.model.generate(batch, max_new_tokens=5, do_sample=False)

    trainer = pl.Trainer(accelerator="cpu", strategy="lazytrain", logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    out = trainer.predict(Predict(copy.deepcopy(model)), loader([prompt]))
    assert torch.equal(out[0], expected)
