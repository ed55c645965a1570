"""One benchmark row in a child process of the script that defines it: no host model, pinned cache or allocator
state is shared between rows. The child runs ``script --child <spec JSON> --child-out <file>`` and writes its result
there with ``write_json``; the parent reads it back, or says why there is none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_json(path: str, result: dict) -> None:
    """``result`` at ``path``, never half-written (a temp name, then the rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, default=str)
    os.replace(tmp, path)


def run_child(script: str, spec: dict, env: dict[str, str], timeout_s: float) -> tuple[dict | None, str, float]:
    """``script``'s child for ``spec`` with ``env`` added, under ``timeout_s``; the child imports this checkout,
    installed or not. Returns its result (None when it left none), why it left none, and the child's whole wall
    time (imports, model build, setup and every step)."""
    path = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(script), "--child", json.dumps(spec), "--child-out", out]
        start = time.perf_counter()
        try:
            rc = subprocess.run(cmd, env={**os.environ, **env, "PYTHONPATH": path}, timeout=timeout_s,
                                cwd=os.getcwd()).returncode
        except subprocess.TimeoutExpired:
            return None, f"timeout {timeout_s:.0f}s", time.perf_counter() - start
        wall = time.perf_counter() - start
        if not os.path.exists(out):
            return None, f"child exited {rc}", wall
        with open(out) as f:
            return json.load(f), "", wall
