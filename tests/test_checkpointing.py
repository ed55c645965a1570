"""ResumableModelCheckpoint: the disk check at fit start, weights-only saves that load back, filenames without
folders, and saves that go through the strategy's AtomicCheckpointIO."""

import os

import lightning.pytorch as pl
import pytest
import torch
from helpers import LMModule, batches, loader, tiny_model
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_lazytrain  # noqa: F401  (registers the strategy name)
from lightning_lazytrain.checkpoint.atomic import verify_checkpoint
from lightning_lazytrain.schedule.disk import checkpoints_kept
from lightning_lazytrain.sft import checkpointing
from lightning_lazytrain.sft.checkpointing import CheckpointDiskError, ResumableModelCheckpoint

STEPS = 4


def _fit(dirpath, module=None, every=2, **callback_kw):
    module = module or LMModule(tiny_model("qwen2", seed=1))
    saver = ResumableModelCheckpoint(dirpath=dirpath, every_n_train_steps=every, **callback_kw)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", precision="32-true", max_steps=STEPS,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[saver],
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, loader(batches(STEPS)))
    return module, trainer, saver


def _num_params():
    return sum(p.numel() for p in tiny_model("qwen2", seed=1).parameters())


def test_kept_counts_a_last_copy_but_not_a_link():
    assert checkpoints_kept(2, True) == 3
    assert checkpoints_kept(2, "link") == 2
    assert checkpoints_kept(0, "link") == 1  # nothing to link to: last.ckpt is a file
    assert checkpoints_kept(1, False) == 1
    assert checkpoints_kept(-1, "link", saves=5) == 5


def test_too_small_disk_is_refused_at_fit_start(tmp_path, monkeypatch):
    n = _num_params()
    # save_top_k=2 + a last.ckpt copy + 1 being saved = 4 checkpoints of n x (4 B fp32 masters + 8 B AdamW moments,
    # which torch makes at the first step: assumed before it)
    need = 4 * n * 12
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: need - 1)
    module = LMModule(tiny_model("qwen2", seed=1))
    with pytest.raises(CheckpointDiskError) as err:
        _fit(tmp_path / "ckpt", module, monitor="step", mode="max", save_top_k=2, save_last=True)
    message = str(err.value)
    assert str(tmp_path / "ckpt") in message
    assert f"need {need / 1e9:.1f} GB" in message and f"{(need - 1) / 1e9:.1f} GB is free" in message
    assert "4 full-state checkpoints (3 kept, 1 being saved)" in message
    assert "12.00 B optimizer states" not in message and "8.00 B optimizer states" in message
    for fix in ("dirpath", "save_top_k (now 2", "save_last: link", "save_weights_only: true"):
        assert fix in message
    assert module.losses == [], "refused before the first step"
    assert not (tmp_path / "ckpt").exists() or not os.listdir(tmp_path / "ckpt")
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: need)
    _, trainer, _ = _fit(tmp_path / "ckpt", monitor="step", mode="max", save_top_k=2, save_last=True)
    assert trainer.global_step == STEPS


def test_a_run_shorter_than_the_save_interval_needs_only_its_last_ckpt(tmp_path, monkeypatch):
    """4 steps, a save every 250: no top-k save, so last.ckpt is a file (the link has nothing to point to); it
    and its replacement being written are all the disk holds."""
    need = 2 * _num_params() * 12
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: need - 1)
    with pytest.raises(CheckpointDiskError, match=r"2 full-state checkpoints \(1 kept, 1 being saved\)"):
        _fit(tmp_path / "a", every=250, monitor="step", mode="max", save_top_k=2, save_last="link")
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: need)
    _, _, saver = _fit(tmp_path / "b", every=250, monitor="step", mode="max", save_top_k=2, save_last="link")
    assert sorted(os.listdir(tmp_path / "b")) == ["last.ckpt", "last.ckpt.manifest.json"]
    assert not os.path.islink(saver.last_model_path)


def test_weights_only_is_sized_as_masters_and_loads_back(tmp_path, monkeypatch):
    n = _num_params()
    full, weights = 2 * n * 12, 2 * n * 4  # save_top_k=1, last as a link: 1 kept + 1 being saved
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: weights)
    with pytest.raises(CheckpointDiskError, match="full-state"):
        _fit(tmp_path / "full", save_last="link")
    trained, _, saver = _fit(tmp_path / "w", save_last="link", save_weights_only=True)
    assert weights < full
    last = tmp_path / "w" / "last.ckpt"
    assert os.path.islink(last) and os.path.realpath(last) == saver.best_model_path
    verify_checkpoint(last)  # written by AtomicCheckpointIO: its manifest accepts it
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == STEPS and "optimizer_states" not in ckpt
    assert not any(k.startswith("optimizer") for k in ckpt)
    fresh = LMModule(tiny_model("qwen2", seed=9))
    assert not torch.equal(fresh.model.lm_head.weight, trained.model.lm_head.weight)
    # back through the strategy's verified load (validate with ckpt_path)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", precision="32-true", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.validate(fresh, loader(batches(1)), ckpt_path=str(last), verbose=False)
    for (name, got), want in zip(fresh.state_dict().items(), trained.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_files_it_manages_count_as_free_on_resume(tmp_path, monkeypatch):
    _, _, saver = _fit(tmp_path / "ckpt", save_last="link")
    size = os.path.getsize(saver.best_model_path)
    resumed = ResumableModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last="link")
    resumed.load_state_dict(saver.state_dict())
    assert resumed._own_files_bytes() == size  # last.ckpt links to it: counted once


def test_metric_names_make_no_folders(tmp_path):
    metrics = {"epoch": torch.tensor(0), "step": torch.tensor(250), "val/loss": torch.tensor(1.23456)}
    template = "{epoch}-{step}-{val/loss:.2f}"
    plain = ModelCheckpoint(dirpath=tmp_path, filename=template).format_checkpoint_name(dict(metrics))
    assert os.path.dirname(plain) != str(tmp_path), "Lightning's own name has a folder in it"
    ours = ResumableModelCheckpoint(dirpath=tmp_path, filename=template)
    path = ours.format_checkpoint_name(dict(metrics))
    assert path == str(tmp_path / "epoch=0-step=250-val_loss=1.23.ckpt")
    bare = ResumableModelCheckpoint(dirpath=tmp_path, filename="{val/loss:.3f}", auto_insert_metric_name=False)
    assert bare.format_checkpoint_name(dict(metrics)) == str(tmp_path / "1.235.ckpt")
    last = ours.format_checkpoint_name(dict(metrics), ours.CHECKPOINT_NAME_LAST)
    assert last == str(tmp_path / "last.ckpt")


@pytest.mark.gpu
def test_on_the_gpu_the_check_sizes_hybrid_adamw_states_and_mfu_is_logged(tmp_path, monkeypatch):
    """Streamed on CUDA: the disk check reads HybridAdamW's own state bytes (8-bit codes) at the checkpoint dir,
    the save goes through, and perf/mfu is logged against the GPU table's peak."""
    from lightning_lazytrain.optim import HybridAdamW
    from lightning_lazytrain.sft.metrics import ThroughputMetrics

    class Hybrid(LMModule):
        def configure_optimizers(self):
            return HybridAdamW(self.parameters(), lr=1e-3, eight_bit_fraction=1.0, min_8bit_numel=1024)

    seen = {}

    def record(path):
        seen["path"] = path
        return 1 << 50

    monkeypatch.setattr(checkpointing, "free_bytes", record)
    module = Hybrid(tiny_model("qwen2", seed=1))
    saver = ResumableModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last="link")
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy="lazytrain", precision="bf16-mixed", max_steps=2,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[saver, ThroughputMetrics()])
    trainer.fit(module, loader(batches(2)))
    assert seen["path"] == str(tmp_path)
    state = checkpointing.optimizer_state_bytes(trainer.optimizers)
    assert 0 < state < 3 * _num_params(), "8-bit moments: about 2 B/param, not AdamW's 8"
    assert "perf/mfu" in trainer.callback_metrics
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2 and "optimizer_states" in ckpt
