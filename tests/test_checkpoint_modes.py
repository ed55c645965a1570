"""Checkpoint modes against the disk (``schedule/checkpoint_modes.py``): the sizes, a refusal at fit start that
names the modes that fit, and a disk that fills during a save losing nothing (real small tmpfs mounts)."""

import os

import lightning.pytorch as pl
import pytest
import torch
from helpers import LMModule, batches, loader, small_tmpfs, tiny_model

import lightning_lazytrain  # noqa: F401  (registers the strategy name)
from lightning_lazytrain.checkpoint.atomic import AtomicCheckpointIO, verify_checkpoint
from lightning_lazytrain.schedule.checkpoint_modes import checkpoint_modes, fitting_modes_text
from lightning_lazytrain.sft.checkpointing import CheckpointDiskError, ResumableModelCheckpoint

N = 10**9


def test_mode_sizes_per_parameter():
    mixed = {m.name: m for m in checkpoint_modes(N, "bf16-mixed", 8.0, kept=2, free_bytes=10**12)}
    assert mixed["full state"].bytes_each == 12 * N and mixed["full state"].need_bytes == 36 * N
    assert mixed["bf16 weights with 8-bit states"].bytes_each == 4 * N
    assert mixed["weights only"].bytes_each == 4 * N  # the fp32 masters as held
    true8 = {m.name: m for m in checkpoint_modes(N, "bf16-true", 2.0, kept=1, free_bytes=5 * N)}
    assert true8["full state"].bytes_each == true8["bf16 weights with 8-bit states"].bytes_each == 4 * N
    assert [m.fits for m in true8.values()] == [False, False, True]  # 2 x 4 GB > 5 GB >= 2 x 2 GB


def test_none_fitting_says_so_and_what_one_fewer_saves():
    text = fitting_modes_text(checkpoint_modes(N, "bf16-true", 2.0, kept=2, free_bytes=N), kept=2)
    assert text.startswith("no checkpoint mode fits (2 kept + 1 being saved)")
    assert "weights only: 5.59 GiB (1.86 GiB each)" in text and "keeping 1 instead of 2 saves 1.86 GiB" in text


def _fit(dirpath, **callback_kw):
    module = LMModule(tiny_model("qwen2", seed=1))
    saver = ResumableModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_last="link", **callback_kw)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="lazytrain",
        precision="32-true",
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, loader(batches(4)))
    return module


def test_refusal_on_a_small_disk_names_the_modes_that_fit_and_writes_nothing(tmp_path):
    n = sum(p.numel() for p in tiny_model("qwen2", seed=1).parameters())
    # 2 copies (1 kept + 1 being saved): full state 2 x 12 B/param = 5.1 MB, weights only 2 x 4 B = 1.7 MB
    with small_tmpfs(tmp_path / "disk", 3 << 20) as disk:
        with pytest.raises(CheckpointDiskError) as info:
            _fit(disk / "ckpt")
        msg = str(info.value)
        assert "checkpoint modes that fit: bf16 weights with 8-bit states" in msg
        assert f"weights only: {2 * 4 * n / 2**30:.2f} GiB" in msg and "save_weights_only: true" in msg
        assert "fit: full state" not in msg
        assert not (disk / "ckpt").exists() or os.listdir(disk / "ckpt") == []
        trained = _fit(disk / "ckpt", save_weights_only=True)  # the mode it named trains and saves there
        names = sorted(os.listdir(disk / "ckpt"))
        assert not [x for x in names if x.endswith(".tmp")]
        saved = torch.load(disk / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
        assert all(torch.equal(saved[k], v) for k, v in trained.state_dict().items())


def test_a_disk_that_fills_during_a_save_keeps_the_previous_checkpoint_whole(tmp_path):
    io = AtomicCheckpointIO()
    small = {"state_dict": {"w": torch.arange(64 * 1024, dtype=torch.float32)}, "global_step": 1}  # 256 KiB
    large = {"state_dict": {"w": torch.ones(256 * 1024, dtype=torch.float32)}, "global_step": 2}  # 1 MiB
    with small_tmpfs(tmp_path / "disk", 1 << 20) as disk:
        path = disk / "last.ckpt"
        io.save_checkpoint(small, path)
        used = sorted(os.listdir(disk))
        with pytest.raises(OSError) as info:
            io.save_checkpoint(large, path)
        assert info.value.errno == 28 and "previous checkpoint is left as it was" in str(info.value)  # ENOSPC
        assert sorted(os.listdir(disk)) == used, "no temporary file or half manifest is left behind"
        verify_checkpoint(path)
        assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], small["state_dict"]["w"])
