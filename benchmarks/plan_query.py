"""What ``lazytrain plan`` says of a benchmark's batch, read from its JSON, for the scripts that record the plan's
prediction beside the measured row."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil


def plan_asked(recipe: str, shape: str, batch: int, timeout_s: float = 180.0) -> dict:
    """What ``lazytrain plan --config recipe`` says of ``batch`` at the named ``shape`` on an H200 with this host's
    available RAM (analytic times, no search): its JSON's ``asked`` entry, or ``{"error": <stderr's tail>}``."""
    cmd = [sys.executable, "-m", "lightning_lazytrain.sft.cli", "plan", "--config", recipe, "--model.model_config",
           shape, "--gpu", "h200", "--data.batch_size", str(batch), "--host_ram_gib",
           f"{psutil.virtual_memory().available / 2**30:.1f}", "--max_batch", "false", "--json", "true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        return {"error": proc.stderr[-400:]}
    return json.loads(proc.stdout)["asked"]
