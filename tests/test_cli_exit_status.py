"""The installed ``lazytrain`` console script, run as a process: exit 0 after a run, 2 for a refused data file, 1
when the run fails (after the traceback, a one-line summary); the config errors (2) through its entry point in this
process."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_in_process import lazytrain_in_process

from lightning_lazytrain.sft.cli import DEMO_RECIPE

TESTS = Path(__file__).resolve().parent
LAZYTRAIN = Path(sys.executable).with_name("lazytrain")  # the console script pip installed beside this python
# a few steps of the demo, small enough for a test
FEW_STEPS = ["--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1", "--data.max_eval_samples", "8",
             "--data.eval_batch_size", "8", "--model.max_generate_samples", "8", "--model.max_new_tokens", "4"]


def lazytrain(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    assert LAZYTRAIN.is_file(), f"{LAZYTRAIN} missing: install the package (pip install -e .) before testing"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([str(LAZYTRAIN), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_a_finished_run_exits_0_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    export = tmp_path / "hf"
    proc = lazytrain(["fit", "--config", str(DEMO_RECIPE), "--trainer.max_steps", "2", *FEW_STEPS,
                      "--trainer.logger.init_args.save_dir", str(tmp_path), "--export_dir", str(export)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "object at 0x" not in proc.stdout and "Traceback" not in proc.stderr
    # the bar's title: 2 steps of a 132-batch epoch are all in epoch 0 (Lightning's own bar said "Epoch 0/-2")
    assert "Epoch 0/0" in proc.stdout and "/-2" not in proc.stdout
    (metrics_file,) = tmp_path.rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    perf = [r for r in rows if r.get("perf/tokens_per_s")]
    assert perf and float(perf[-1]["perf/tokens_per_s"]) > 0 and float(perf[-1]["perf/model_tflops"]) > 0
    val = [r for r in rows if r.get("val/exact_match")]
    assert len(val) == 1 and 0.0 <= float(val[0]["val/exact_match"]) <= 1.0
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.config.hidden_size == 64 and (export / "tokenizer.json").is_file()


@pytest.mark.parametrize(("args", "words"), [
    (["--model.model_config", "null"], ["the config cannot be built", "ValueError", "exactly one of `pretrained`"]),
    (["--trainer.max_stepz", "2"], ["max_stepz"]),
])
def test_a_config_error_exits_2_without_a_traceback(tmp_path, args, words):
    proc = lazytrain_in_process(["fit", "--config", str(DEMO_RECIPE), *args], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and all(w in proc.stderr for w in words), proc.stderr[-3000:]


def test_a_failed_run_exits_1_with_its_traceback_and_a_summary(tmp_path):
    overlay = tmp_path / "fail.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "run_faults.FailAtStep", "init_args": {"step": 1}}]}}))
    proc = lazytrain(["fit", "--config", str(DEMO_RECIPE), "--config", str(overlay), "--trainer.max_steps", "3",
                      "--trainer.limit_val_batches", "0", "--trainer.logger.init_args.save_dir", str(tmp_path)],
                     tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and 'run_faults.py", line' in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "lazytrain: error: the run failed: RuntimeError: injected failure at step 1")


def test_a_refused_data_file_leaves_no_empty_log_directory(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"query": "1 + 1?"}\n')
    (tmp_path / "runs" / "lightning_logs" / "version_0").mkdir(parents=True)
    (tmp_path / "runs" / "lightning_logs" / "version_0" / "metrics.csv").write_text("step\n")  # an earlier run's
    proc = lazytrain(["fit", "--config", str(DEMO_RECIPE), "--data.data_path", "bad.jsonl",
                      "--trainer.logger.init_args.save_dir", "runs"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "bad.jsonl:1 field 'response': missing" in proc.stderr.splitlines()[-1]
    assert sorted(p.name for p in (tmp_path / "runs" / "lightning_logs").iterdir()) == ["version_0"]
    assert [p.name for p in (tmp_path / "runs" / "lightning_logs" / "version_0").iterdir()] == ["metrics.csv"]
