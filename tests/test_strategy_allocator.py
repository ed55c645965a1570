"""``Trainer(strategy="lazytrain")`` from Python gets the allocator setting the ``lazytrain`` command sets: expandable
segments, asked for before Lightning starts CUDA, unless the user configured the allocator."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os
from lightning_lazytrain import LazyTrainStrategy
LazyTrainStrategy()
print(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
"""


@pytest.mark.parametrize("preset", [None, "max_split_size_mb:128"])
def test_making_the_strategy_asks_for_expandable_segments_unless_the_user_chose(preset):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if preset is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = preset
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == (preset or "expandable_segments:True")
