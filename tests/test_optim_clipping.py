"""Clipping helpers against torch.nn.utils.clip_grad_norm_, and the non-finite guard."""

import math

import pytest
import torch

from lightning_lazytrain.optim import HybridAdamW, NonFiniteGuard, clip_coefficient, grad_norm_sq


def _grads(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) * 3 for s in [(100, 30), (4096,), (3,)]]


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_matches_torch(max_norm):
    grads = _grads()
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    nsq = grad_norm_sq(grads + [None])
    assert nsq.dtype == torch.float32
    torch.testing.assert_close(nsq.sqrt(), total, rtol=1e-6, atol=0)
    coef = clip_coefficient(nsq, max_norm)
    assert (coef < 1.0) == (max_norm < 1.0)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(g * coef, p.grad, rtol=1e-6, atol=1e-7)


def test_clip_fused_into_step_equals_torch_clip_then_adamw():
    grads = _grads()
    ref = [torch.ones_like(g, requires_grad=True) for g in grads]
    mine = [torch.ones_like(g) for g in grads]
    for p, g in zip(ref, grads, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.optim.AdamW(ref, lr=0.1).step()
    opt = HybridAdamW(mine, lr=0.1)
    opt.step_params(mine, clip_coefficient(grad_norm_sq(grads), 1.0), grads)
    for a, b in zip(ref, mine, strict=True):
        torch.testing.assert_close(b, a.detach(), rtol=1e-6, atol=1e-6)


def test_bf16_norm_summed_in_fp32():
    grads = _grads(torch.bfloat16)
    expected = sum(float(g.double().square().sum()) for g in grads)
    assert math.isclose(float(grad_norm_sq(grads)), expected, rel_tol=1e-5)


def test_non_finite_detected_and_guard_aborts_after_three():
    grads = _grads()
    grads[1][5] = float("nan")
    nsq = grad_norm_sq(grads)
    assert math.isnan(clip_coefficient(nsq, 1.0))
    guard = NonFiniteGuard()
    assert guard.check(1.0, step=1)
    assert not guard.check(nsq, step=2)
    assert not guard.check(float("inf"), step=3)
    assert guard.check(4.0, step=4)  # a finite step resets the streak
    assert guard.skipped == 2 and guard.consecutive == 0
    assert not guard.check(nsq, step=5)
    assert not guard.check(nsq, step=6)
    state = guard.state_dict()
    resumed = NonFiniteGuard()
    resumed.load_state_dict(state)
    with pytest.raises(RuntimeError, match=r"step 7.*3 steps in a row"):
        resumed.check(nsq, step=7)
