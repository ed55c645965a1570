"""The Triton loss kernel's arithmetic on the CPU, through Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported, hence a child process), against torch's logsumexp and the softmax gradient.

The interpreter converts fp32 to bf16 by truncation where the GPU rounds to nearest, so bf16 is held to one ulp;
``test_gpu_loss_kernel.py`` checks the GPU's rounding."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="triton (the test extra) ships Linux wheels only")

CHILD = r"""
import json, sys, torch
from lightning_lazytrain.engine.loss.kernel import MAX_BLOCK, row_loss_and_grad_

gen = torch.Generator().manual_seed(0)
rows, cols, scale = 6, 2 * MAX_BLOCK + 77, 0.25  # two full blocks and a masked one
out = {}
for name in ("float64", "float32", "bfloat16"):
    dtype = getattr(torch, name)
    x = (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 4).to(dtype)
    target = torch.randint(0, cols, (rows,), generator=gen)
    target[0], target[1] = 0, cols - 1  # the first and the last column
    xf = x.double()
    lse = torch.logsumexp(xf, -1)
    loss = lse - xf.gather(1, target[:, None]).squeeze(1)
    grad = (xf - lse[:, None]).exp()
    grad[torch.arange(rows), target] -= 1.0
    grad *= scale
    kept = x.clone()
    no_grad_loss = row_loss_and_grad_(kept, target, scale, with_grad=False)
    got = x.clone()
    got_loss = row_loss_and_grad_(got, target, scale, with_grad=True)
    out[name] = {
        "loss_err": ((got_loss.double() - loss).abs() / loss.abs()).max().item(),
        "no_grad_same": bool(torch.equal(no_grad_loss, got_loss) and torch.equal(kept, x)),
        # fp32 and float64: against the largest gradient, as test_engine_loss.py; bf16: per element, in ulps
        "grad_err": ((got.double() - grad).abs().max() / grad.abs().max()).item(),
        "grad_err_ulps": ((got.double() - grad).abs() / (grad.abs() * torch.finfo(torch.bfloat16).eps)).max().item(),
        "loss_dtype": str(got_loss.dtype),
        "target_grad_negative": bool((got[torch.arange(rows), target] < 0).all()),
    }
json.dump(out, sys.stdout)
"""


def test_kernel_arithmetic_in_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for name, r in result.items():
        assert r["loss_dtype"] == "torch.float32", name
        assert r["no_grad_same"], name  # without gradients the logits are left as they were
        assert r["target_grad_negative"], name  # the one-hot is subtracted at the target column
        assert r["loss_err"] <= 1e-6, (name, r)  # the log-sum-exp in fp32
    assert result["float64"]["grad_err"] <= 1e-6 and result["float32"]["grad_err"] <= 1e-6
    assert result["bfloat16"]["grad_err_ulps"] <= 1.01  # truncated, not rounded (above)
