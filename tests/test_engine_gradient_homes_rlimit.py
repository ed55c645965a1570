"""A model whose store plus all its gradients exceed the process's memory limit trains under it with the gradients
on NVMe, and does not with them on the host (``RLIMIT_AS`` in a child process, ``rlimit_child.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("rlimit_child.py")


def _run(home: str, limit: int, spill_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "PYTHONPATH": os.pathsep.join([str(CHILD.parent), os.getcwd()])}
    return subprocess.run(
        [sys.executable, str(CHILD), home, str(limit), str(spill_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def _peak(proc: subprocess.CompletedProcess) -> tuple[int, int]:
    assert proc.returncode == 0, proc.stderr[-2000:]
    words = proc.stdout.split()
    return int(words[words.index("params") + 1]), int(words[words.index("vmpeak") + 1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status are Linux's")
def test_nvme_home_trains_under_a_limit_the_gradients_would_break(tmp_path):
    params, peak = _peak(_run("nvme", 0, tmp_path))
    grads = 4 * params  # fp32 under 32-true
    limit = peak + grads // 4  # the nvme run's own peak and a quarter of the gradients: all of them do not fit
    assert _peak(_run("nvme", limit, tmp_path))[1] <= limit
    host = _run("host", limit, tmp_path)
    assert host.returncode != 0, "the host home must not fit the limit, or the limit tests nothing"
    assert "memory" in host.stderr.lower() or "alloc" in host.stderr.lower(), host.stderr[-2000:]
