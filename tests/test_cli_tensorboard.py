"""TensorBoard as one line of a recipe (docs/recipes.md): the CPU demo with ``--trainer.logger TensorBoardLogger``
writes train/loss and perf/mfu to the event file; without tensorboard installed it is one usage error (exit 2)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_lazytrain.sft import cli

LAZYTRAIN = Path(sys.executable).with_name("lazytrain")
TB = ["--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger"]
PEAK = 0.5  # TFLOPS: the CPU has no entry in the GPU table, so MFU is logged against this given peak


def test_without_tensorboard_the_logger_is_one_usage_error(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["lazytrain"])
    monkeypatch.setattr("lightning.fabric.loggers.tensorboard._TENSORBOARD_AVAILABLE", False)
    monkeypatch.setattr("lightning.fabric.loggers.tensorboard._TENSORBOARDX_AVAILABLE", False)
    assert cli.main(["fit", "--config", "demo", *TB]) == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lazytrain: error")]
    assert "TensorBoardLogger, which needs the tensorboard package" in line
    assert "pip install 'lightning-lazytrain[tensorboard]'" in line


def test_the_demo_logs_loss_and_mfu_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install 'lightning-lazytrain[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = subprocess.run(
        [str(LAZYTRAIN), "fit", "--config", "demo", *TB, "--trainer.max_steps", "3", "--trainer.log_every_n_steps",
         "1", "--trainer.callbacks.init_args.peak_tflops", str(PEAK), "--data.max_samples", "128"],
        cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (events,) = (tmp_path / "runs" / "demo").rglob("events.out.tfevents.*")  # the recipe's save_dir stays
    acc = EventAccumulator(str(events))
    acc.Reload()
    loss = [e.value for e in acc.Scalars("train/loss")]
    assert [e.step for e in acc.Scalars("train/loss")] == [0, 1, 2]
    assert all(11.0 < v < 12.5 for v in loss), loss  # random init over 151,669 ids: near ln(151669) = 11.93
    tflops = {e.step: e.value for e in acc.Scalars("perf/model_tflops")}
    mfu = {e.step: e.value for e in acc.Scalars("perf/mfu")}
    assert mfu.keys() == tflops.keys() and mfu
    assert all(mfu[s] == pytest.approx(tflops[s] / PEAK, rel=1e-5) for s in mfu)
