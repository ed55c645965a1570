"""``lazytrain fit --ckpt_path last`` through the CLI, with the recipes' checkpoint callback: a run that dies after
step 3 (its newest save is step 2) and is resumed ends with the weights and optimizer states of an unbroken run."""

import csv
import json
import os
import re

import pytest
import torch
from cli_in_process import lazytrain_in_process
from resume_setup import assert_same_tree
from test_cli_exit_status import lazytrain

from lightning_lazytrain.sft.cli import main

TINY = dict(model_type="qwen2", vocab_size=151669, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True)
STEPS = 6


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["lazytrain"])  # LightningCLI warns when pytest's argv is there too


def _args(run_dir, crash_at=None, steps=STEPS, weights_only=False):
    callbacks = [{
        "class_path": "lightning_lazytrain.sft.checkpointing.ResumableModelCheckpoint",
        "init_args": {"dirpath": str(run_dir / "checkpoints"), "every_n_train_steps": 2, "monitor": "step",
                      "mode": "max", "save_top_k": 2, "save_last": "link", "save_weights_only": weights_only},
    }]
    if crash_at is not None:
        callbacks.append({"class_path": "resume_setup.CrashAt", "init_args": {"step": crash_at}})
    args = ["fit", "--config", "demo", "--model.model_config", json.dumps(TINY),
            "--model.optimizer", "lightning_lazytrain.optim.HybridAdamW",
            "--model.optimizer_kwargs", json.dumps({"eight_bit_fraction": 0.5, "min_8bit_numel": 1024}),
            "--model.warmup_steps", "2", "--data.max_samples", "48", "--data.batch_size", "4",
            "--data.val_fraction", "0.1", "--data.max_seq_length", "48", "--trainer.max_steps", str(steps),
            "--trainer.limit_val_batches", "0", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_checkpointing", "true", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(run_dir / "logs"), "--trainer.callbacks", json.dumps(callbacks)]
    return args


def _lazytrain(run_dir, crash_at=None):
    return main(_args(run_dir, crash_at))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An unbroken run, and a run that dies after step 3 and is resumed by ``lazytrain fit --ckpt_path last`` run
    as a process with its progress bar on (the bar changes nothing of what the run trains or saves)."""
    root = tmp_path_factory.mktemp("resume_cli")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", ["lazytrain"])  # LightningCLI warns when pytest's argv is there too
        unbroken = _lazytrain(root / "ref")
        crashed = _lazytrain(root / "run", crash_at=3)
    saved_step = torch.load(root / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    args = _args(root / "run")
    args[args.index("--trainer.enable_progress_bar") + 1] = "true"
    resumed = lazytrain([*args, "--ckpt_path", "last"], root)
    return root, (unbroken, crashed, saved_step), resumed


def _losses(metrics_csv):
    rows = csv.DictReader(open(metrics_csv))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def test_cli_resume_from_last_matches_an_unbroken_run(runs):
    tmp_path, (unbroken_status, crashed_status, saved_step), resumed_proc = runs
    assert unbroken_status == 0
    assert crashed_status == 1  # the run failed: exit status 1
    crashed = tmp_path / "run" / "checkpoints"
    assert saved_step == 2
    assert resumed_proc.returncode == 0, resumed_proc.stderr[-3000:]

    names = sorted(n for n in os.listdir(crashed) if n.endswith(".ckpt"))
    assert names == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]  # 2 kept; last links to the newest
    assert all(os.path.exists(crashed / f"{n}.manifest.json") for n in names[:2]), "saved by AtomicCheckpointIO"
    ref = torch.load(tmp_path / "ref" / "checkpoints" / "last.ckpt", weights_only=True)
    got = torch.load(crashed / "last.ckpt", weights_only=True)
    assert got["global_step"] == ref["global_step"] == STEPS
    assert_same_tree(got["state_dict"], ref["state_dict"], "weights")
    assert_same_tree(got["optimizer_states"], ref["optimizer_states"], "optimizer")
    assert_same_tree(got["lr_schedulers"], ref["lr_schedulers"], "lr_scheduler")

    # the resumed process trained steps 3..6 only (logged 0-based: 2..5), with the unbroken run's losses
    ref_losses = _losses(next((tmp_path / "ref" / "logs").rglob("metrics.csv")))
    resumed_csv = tmp_path / "run" / "logs" / "lightning_logs" / "version_1" / "metrics.csv"
    resumed = _losses(resumed_csv)
    assert sorted(ref_losses) == list(range(STEPS)) and sorted(resumed) == list(range(2, STEPS))
    assert resumed == {s: ref_losses[s] for s in range(2, STEPS)}


def test_fit_from_a_weights_only_checkpoint_is_refused_with_exit_2(tmp_path):
    """Lightning's own answer is a KeyError from inside fit (exit 1, a traceback): the console script refuses it
    as a usage error instead, naming the file behind last.ckpt and the setting that makes resumable saves."""
    assert main(_args(tmp_path, steps=2, weights_only=True)) == 0
    saved = tmp_path / "checkpoints" / "epoch=0-step=2.ckpt"
    assert "optimizer_states" not in torch.load(saved, weights_only=True)
    proc = lazytrain_in_process([*_args(tmp_path, weights_only=True), "--ckpt_path", "last"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyError" not in proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"lazytrain: error: {tmp_path / 'checkpoints' / 'last.ckpt'} (a link to {saved})"), last
    assert "is a weights-only checkpoint" in last and "save_weights_only: false" in last
    assert not (tmp_path / "checkpoints" / "epoch=0-step=4.ckpt").exists(), "refused before any training step"


def test_the_resumed_runs_progress_bar_counts_to_its_total(runs):
    """The resumed process starts at batch 3 of an 11-batch epoch and stops after step 6: the bar ends at 6/6
    (Lightning's own total was the 3 steps left from the resumed batch: 6/3)."""
    proc = runs[2]
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = re.findall(r"Epoch 0/0 .*? (\d+)/(\d+) ", proc.stdout)
    assert counts and counts[-1] == ("6", "6"), proc.stdout[-2000:]
