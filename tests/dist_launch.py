"""Starting ``tests/dist_driver.py`` runs from the tests: through Lightning's launcher, or as separate "machines"."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# the bf16-mixed run that test_distributed and test_distributed_node_load both read (conftest's bf16_mixed_two_procs)
BF16_MIXED_ARGS = ("--clip", "0.05", "--steps", "3", "--precision", "bf16-mixed")


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    # prepend: packages installed outside site-packages (a --target install on PYTHONPATH) must stay importable
    path = os.pathsep.join(p for p in (str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    out.update(PYTHONPATH=path, OMP_NUM_THREADS="1", **extra)
    return out


def check(proc: subprocess.Popen, log: Path, timeout: float = 240) -> int:
    """The process's exit status; it is killed (and the test fails) past ``timeout`` seconds."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{log.name}: still running after {timeout} s:\n{log.read_text()[-4000:]}") from None


def launch(out: Path, *args: str) -> Path:
    """One call of the driver; with ``--devices 2`` (its default) Lightning's launcher starts local rank 1."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(TESTS / "dist_driver.py"), "--out", str(out), *args],
                                env=env(), stdout=f, stderr=subprocess.STDOUT)
        rc = check(proc, log)
    assert rc == 0, log.read_text()[-4000:]
    return out


def start_two_machines(out: Path, *args: str) -> list[tuple[subprocess.Popen, Path]]:
    """Two processes with ``LOCAL_RANK=0`` and ``NODE_RANK=0/1``, as a cluster scheduler starts them."""
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for node in (0, 1):
        log = out / f"log{node}.txt"
        with open(log, "w") as f:
            e = env(LOCAL_RANK="0", NODE_RANK=str(node), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            cmd = [sys.executable, str(TESTS / "dist_driver.py"), "--out", str(out), "--devices", "1",
                   "--num-nodes", "2", *args]
            procs.append((subprocess.Popen(cmd, env=e, stdout=f, stderr=subprocess.STDOUT), log))
    return procs


def launch_two_machines(out: Path, *args: str) -> Path:
    for proc, log in start_two_machines(out, *args):
        rc = check(proc, log)
        assert rc == 0, log.read_text()[-4000:]
    return out
