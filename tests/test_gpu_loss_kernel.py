"""The Triton loss kernel on a GPU against the whole-logits loss, in float64 and under bf16 autocast."""

import pytest
import torch
from test_engine_loss import _close, _inputs, _reference

from lightning_lazytrain.engine.loss.chunked import chunked_causal_lm_loss

pytestmark = pytest.mark.gpu


def _run(h, w, labels, num_items=None, autocast=False, **kwargs):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = chunked_causal_lm_loss(hh, ww, labels, num_items, **kwargs)
    loss.backward()
    return loss.detach(), hh.grad, ww.grad


@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
@pytest.mark.parametrize("num_items", [None, 40])
def test_gpu_kernel_matches_the_whole_logits(chunk_rows, num_items):
    h, w, labels = (t.cuda() for t in _inputs(vocab=3001))  # more columns than one of the kernel's blocks
    loss, gh, gw = _run(h, w, labels, num_items, kernel=True, chunk_bytes=chunk_rows * 8 * w.shape[0])
    ref_loss, ref_h, ref_w = _run(h, w, labels, num_items, kernel=False)
    # the whole-logits reference through torch's own cross-entropy, on the same GPU
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    _reference(hh, ww, labels, num_items).backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert _close(gh, hh.grad) and _close(gw, ww.grad) and _close(gh, ref_h) and _close(gw, ref_w)
    assert gw.abs().max() > 0 and gh[0, :3].abs().max() == 0


def test_gpu_kernel_without_grad_mode_gives_the_loss():
    h, w, labels = (t.cuda() for t in _inputs(vocab=3001))
    with torch.no_grad():
        value = chunked_causal_lm_loss(h, w, labels, kernel=True, chunk_bytes=5 * 8 * w.shape[0])
    assert value.item() == pytest.approx(_reference(h, w, labels).item(), rel=1e-6)


@pytest.mark.parametrize("chunk_rows", [3, 1000])
def test_gpu_kernel_bf16_gradients_are_the_float64_ones_to_bf16_rounding(chunk_rows):
    """The engine's case: bf16 logits overwritten by their bf16 gradient, the weight gradient summed in fp32 by
    the GEMM; the torch ops on the same GPU are held to the same bound."""
    h, w, labels = (t.cuda() for t in _inputs(batch=4, seq=16, hidden=32, vocab=3001))
    hb, wb = h.bfloat16(), w.bfloat16()
    ref_loss, ref_h, ref_w = _run(hb.double(), wb.double(), labels, kernel=False)
    for kernel in (True, False):
        loss, gh, gw = _run(hb, wb, labels, autocast=True, kernel=kernel, chunk_bytes=chunk_rows * 4 * w.shape[0])
        assert loss.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-3)
        for got, want in ((gh, ref_h), (gw, ref_w)):
            assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()
