"""Gradient homes (``engine/grads/homes.py``): every home trains to the weights of a plain Lightning run with
clipping on, and admission's host table counts the gradients only where they wait on the host."""

import copy
import os

import lightning.pytorch as pl
import pytest
import torch
from helpers import LMModule, batches, loader, rel_diff, tiny_model

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.admission import admission_report
from lightning_lazytrain.engine.grads.homes import STAGING_BUFFERS, choose_gradient_home
from lightning_lazytrain.optim import HybridAdamW


class HybridModule(LMModule):
    def configure_optimizers(self):
        return HybridAdamW(self.parameters(), lr=self.lr, weight_decay=0.01, eight_bit_fraction=0.0)


class GradientFiles(pl.Callback):
    """The spill folder's gradient file size, seen after every step (the nvme home writes it)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        staging = trainer.strategy.executor.sink.staging
        self.sizes.append(os.path.getsize(staging.spill.path("gradients")))


def fit(module, data, strategy="auto", callbacks=()):
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=strategy,
        precision="32-true",
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        gradient_clip_val=0.05,
        callbacks=list(callbacks),
    )
    trainer.fit(module, loader(data))
    return module, trainer


@pytest.mark.parametrize("home", ["host", "device", "nvme"])
def test_every_gradient_home_matches_plain_lightning_with_clipping(home, tmp_path):
    model, data = tiny_model("qwen2"), batches(3)
    ref, _ = fit(HybridModule(copy.deepcopy(model)), data)
    files = GradientFiles() if home == "nvme" else None
    strategy = LazyTrainStrategy(gradient_home=home, spill_dir=str(tmp_path) if home == "nvme" else None)
    lt, trainer = fit(HybridModule(copy.deepcopy(model)), data, strategy, [files] if files else [])
    assert rel_diff(ref.model, model) > 1e-3, "clipped steps must move the weights for the comparison to mean much"
    assert rel_diff(lt.model, ref.model) <= 1e-5
    report = trainer.strategy.admission_report  # made at setup
    host = report.tiers["host"].pieces
    trainable = sum(p.numel() for p in model.parameters())
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    staging = STAGING_BUFFERS * 4 * max(layer, model.model.embed_tokens.weight.numel())  # fp32 under 32-true
    if home == "host":
        assert host["gradients"] == 4 * trainable and "pinned slots" not in host
    elif home == "device":  # the CPU accelerator's device is the host: its gradients are host RAM
        assert host["gradients"] == 4 * trainable and host["pinned slots"] == staging
    else:
        assert "gradients" not in host, "gradients off the host are not host RAM"
        assert host["gradient staging"] == staging
        assert report.tiers["disk"].pieces["NVMe gradients"] == 4 * trainable
    if home == "nvme":
        assert files.sizes and all(size == 4 * trainable for size in files.sizes)
        assert os.listdir(tmp_path) == [], "the spill folder is removed at teardown"


def test_staged_home_splits_a_unit_larger_than_a_buffer_into_pieces():
    """The resident unit (embedding + untied head) is larger than a staging buffer: it is staged, and updated, in
    two pieces, and the weights still match (the test above); here the pieces themselves."""
    from lightning_lazytrain.engine.grads.homes import pieces, staging_numel
    from lightning_lazytrain.engine.weights.store import HostParamStore

    model = tiny_model("qwen2")
    resident = [model.model.embed_tokens, model.model.norm, model.lm_head]
    groups = [("resident", resident)] + [(f"layer.{j}", [m]) for j, m in enumerate(model.model.layers)]
    store = HostParamStore(groups, torch.float32, torch.float32, pin=False)
    capacity = staging_numel(store.units)
    resident = pieces(store.units[0], capacity)
    assert len(resident) == 2
    assert [len(pieces(u, capacity)) for u in store.units[1:]] == [1] * 4
    assert sorted(i for p in resident for i in p) == list(range(len(store.units[0].trained)))


def test_plan_picks_the_home_that_fits():
    gib = 2**30
    assert choose_gradient_home(10 * gib, 20 * gib, 100 * gib, None) == "host"
    assert choose_gradient_home(10 * gib, 5 * gib, 100 * gib, None) == "device"
    assert choose_gradient_home(10 * gib, 5 * gib, 15 * gib, "/nvme") == "nvme"
    assert choose_gradient_home(10 * gib, 5 * gib, None, "/nvme") == "nvme"
    assert choose_gradient_home(10 * gib, 5 * gib, None, None) == "host"


def test_admission_counts_gradients_where_they_wait():
    kw = dict(
        num_params=10**9,
        host_have_bytes=2**40,
        gpu_have_bytes=2**40,
        precision="bf16-true",
        optimizer_state_bytes_per_param=2.0,
    )
    host = admission_report(**kw)
    device = admission_report(**kw, gradient_home="device", gradient_staging_bytes=123)
    nvme = admission_report(**kw, gradient_home="nvme", gradient_staging_bytes=123, disk_have_bytes=2**40)
    assert host.tiers["host"].pieces["gradients"] == 2 * 10**9
    for report in (device, nvme):
        assert report.tiers["host"].need == host.tiers["host"].need - 2 * 10**9 + 123
    assert device.tiers["gpu"].pieces["gradients (device home)"] == 2 * 10**9
    assert nvme.tiers["disk"].pieces["NVMe gradients"] == 2 * 10**9


def test_a_host_short_of_the_gradients_is_told_of_the_other_homes():
    report = admission_report(
        num_params=10**9,
        host_have_bytes=5 * 10**9,
        gpu_have_bytes=0,
        precision="bf16-true",
        optimizer_state_bytes_per_param=2.0,
    )
    assert any("gradient_home='device'" in s and "(enough)" in s for s in report.suggestions)


def test_unknown_home_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"gradient_home must be one of \('plan', 'device', 'host', 'nvme'\)"):
        LazyTrainStrategy(gradient_home="disk")


def test_nvme_home_without_spill_dir_is_refused_at_setup():
    with pytest.raises(ValueError, match="gradient_home='nvme' needs a spill_dir"):
        fit(HybridModule(tiny_model("qwen2")), batches(1), LazyTrainStrategy(gradient_home="nvme"))


def test_staged_home_with_a_torch_optimizer_is_refused_at_setup():
    with pytest.raises(ValueError, match="gradient_home='device' needs the engine's own updates"):
        fit(LMModule(tiny_model("qwen2")), batches(1), LazyTrainStrategy(gradient_home="device"))
