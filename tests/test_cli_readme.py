"""README's commands for a newcomer's own data, run as README gives them (the shell block that uses the shipped
chat set), each ``lazytrain fit`` shortened to 2 steps: exit status 0, 2 losses logged, the model shape asked."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent  # `lazytrain` and `python` as a newcomer's shell finds them after pip install
SHORT = "--trainer.max_steps 2 --trainer.log_every_n_steps 1 --data.max_samples 64 --trainer.limit_val_batches 0"


def _block() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
    (block,) = [b for b in blocks if "demo_chat" in b]
    return block.strip().splitlines()


LINES = _block()
FITS = [line for line in LINES if line.startswith("lazytrain fit")]


def test_the_block_has_the_runs_the_done_when_asks_for():
    assert len(FITS) == 3
    assert any("model_type llama" in f for f in FITS) and any("model_type qwen3" in f for f in FITS)
    assert any("chat.parquet" in f for f in FITS)


@pytest.mark.parametrize("fit", FITS, ids=["llama-jsonl", "qwen3-jsonl", "parquet"])
def test_readme_sft_command_exits_0(tmp_path, fit):
    setup = [line for line in LINES if "=" in line.split()[0]]  # CHAT=...
    if "chat.parquet" in fit:
        setup += [line for line in LINES if line.startswith("python") and "chat.parquet" in line]
    script = "\n".join(["set -e", *setup, f"{fit} {SHORT}"])
    env = {**os.environ, "PATH": os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")]),
           "LAZYTRAIN_CACHE": str(tmp_path / "cache")}  # a fresh machine: nothing tokenized yet
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shape = "Llama" if "llama" in fit else "Qwen3" if "qwen3" in fit else "Qwen2"
    assert f"{shape}ForCausalLM" in proc.stdout, proc.stdout[-2000:]
    assert "<|im_start|>user" in proc.stderr, proc.stderr[-2000:]  # the logged sample is a chat conversation
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")
    losses = [float(r["train/loss"]) for r in csv.DictReader(metrics.open()) if r.get("train/loss")]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses), losses
