"""One benchmark row in a child process of the script that defines it: no host model, pinned cache or allocator
state is shared between rows. The child runs ``script --child <spec JSON> --child-out <file>`` and writes its result
there with ``write_json``; the parent reads it back, or says why there is none."""

from __future__ import annotations

import argparse
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


def add_child_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden ``--child`` and ``--child-out`` that ``run_child`` passes to the script."""
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)


def ran_as_child(args: argparse.Namespace, child) -> bool:
    """Whether ``args`` are a child's: then ``child(spec, out)`` has run."""
    if args.child:
        child(json.loads(args.child), args.child_out)
    return bool(args.child)


def run_child(script: str, spec: dict, env: dict[str, str], timeout_s: float, checkout: str = REPO,
              cwd: str | None = None) -> tuple[dict | None, str, float]:
    """``script``'s child for ``spec`` with ``env`` added, under ``timeout_s``, in ``cwd`` (default: this
    process's); the child imports ``checkout`` (default: this one), installed or not. Returns its result (None
    when it left none), why it left none, and the child's whole wall time (imports, model build, setup and every
    step)."""
    path = os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(script), "--child", json.dumps(spec), "--child-out", out]
        start = time.perf_counter()
        try:
            rc = subprocess.run(cmd, env={**os.environ, **env, "PYTHONPATH": path}, timeout=timeout_s,
                                cwd=cwd or os.getcwd()).returncode
        except subprocess.TimeoutExpired:
            return None, f"timeout {timeout_s:.0f}s", time.perf_counter() - start
        wall = time.perf_counter() - start
        if not os.path.exists(out):
            return None, f"child exited {rc}", wall
        with open(out) as f:
            return json.load(f), "", wall
