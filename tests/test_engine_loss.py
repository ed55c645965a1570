"""The chunked head loss against the plain one: the same loss and gradients, however the rows fall into chunks."""

import pytest
import torch

from lightning_lazytrain.engine.loss.chunked import IGNORE_INDEX, chunked_causal_lm_loss


def _reference(hidden, weight, labels, num_items=None):
    """transformers' causal-LM loss on the whole logits: shift left, ignore -100, fp32 logits, mean (or sum/N)."""
    logits = (hidden @ weight.t()).float()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="sum")
    count = (shifted != IGNORE_INDEX).sum() if num_items is None else num_items
    return loss / count


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= 1e-6 * b.abs().max())


def _inputs(seed=0, batch=3, seq=11, hidden=16, vocab=37):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.3
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[2, -3:] = IGNORE_INDEX  # padding
    return h, w, labels


@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 1000])
@pytest.mark.parametrize("num_items", [None, 40])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_loss_and_gradients_match_the_whole_logits(chunk_rows, num_items, scale):
    h, w, labels = _inputs()
    vocab = w.shape[0]
    grads = []
    for fn in (_reference, lambda *a: chunked_causal_lm_loss(*a, chunk_bytes=chunk_rows * 4 * vocab)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(hh, ww, labels, num_items)
        (loss * scale).backward()
        grads.append((loss.detach(), hh.grad, ww.grad))
    (ref_loss, ref_h, ref_w), (loss, gh, gw) = grads[0], grads[1]
    # both upcast the logits to fp32 (HF's convention), so they agree to fp32 rounding, not float64's
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert _close(gh, ref_h) and _close(gw, ref_w)
    assert gw.abs().max() > 0 and gh[0, :3].abs().max() == 0  # the ignored rows get no gradient


def test_without_grad_mode_no_gradients_are_made_and_a_backward_names_why():
    h, w, labels = _inputs()
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.no_grad():
        value = chunked_causal_lm_loss(hh, ww, labels)
    assert value.item() == pytest.approx(_reference(h, w, labels).item(), rel=1e-6)
    loss = chunked_causal_lm_loss(hh, ww, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward already ran once"):
        loss.backward()


def test_a_frozen_head_gets_no_weight_gradient():
    h, w, labels = _inputs()
    hh = h.clone().requires_grad_()
    chunked_causal_lm_loss(hh, w, labels, chunk_bytes=5 * 4 * w.shape[0]).backward()
    ref = h.clone().requires_grad_()
    _reference(ref, w, labels).backward()
    assert w.grad is None and _close(hh.grad, ref.grad)


@pytest.mark.parametrize("chunk_rows", [3, 1000])
def test_bf16_autocast_gradients_are_the_float64_ones_to_bf16_rounding(chunk_rows):
    """The engine's case: a bf16 head under autocast, fp32 logits, each chunk's weight gradient added in fp32."""
    h, w, labels = _inputs(batch=4, seq=16, hidden=32, vocab=53)
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_causal_lm_loss(hb, wb, labels, chunk_bytes=chunk_rows * 4 * w.shape[0])
    loss.backward()
    h64, w64 = hb.detach().double().requires_grad_(), wb.detach().double().requires_grad_()
    ref = _reference(h64, w64, labels)
    ref.backward()
    assert loss.dtype == torch.float32 and hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(ref.item(), rel=1e-2)
    for got, want in ((hb.grad, h64.grad), (wb.grad, w64.grad)):
        assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.parametrize("bad", [37, -2])
def test_a_label_outside_the_vocabulary_is_named(bad):
    h, w, labels = _inputs()
    labels[1, 5] = bad
    with pytest.raises(ValueError, match=f"label {bad} is outside the head's vocabulary of 37 tokens"):
        chunked_causal_lm_loss(h, w, labels)


def test_the_triton_kernel_is_refused_off_cuda():
    h, w, labels = _inputs()
    with pytest.raises(ValueError, match="the loss kernel runs on CUDA only; the head is on cpu"):
        chunked_causal_lm_loss(h, w, labels, kernel=True)
