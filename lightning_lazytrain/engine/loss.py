"""Causal-LM loss through the head in row chunks, so the batch x seq x vocab logits never exist at once.

Matches ``transformers``' ``ForCausalLMLoss``: labels shifted left by one, ``-100`` ignored, logits upcast to fp32,
mean over the counted tokens (or a sum divided by ``num_items_in_batch`` when given). Only the rows that carry a
label go through the head at all, which for supervised fine-tuning (loss on the response only) skips the prompt.
Under grad mode each chunk's gradients are computed with its loss (``_ChunkedHeadLoss``), so no logits are kept
and none are computed twice.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
LOSS_CHUNK_BYTES = 1 << 29  # the executor's default: fp32 logits of at most this many bytes per chunk


class _ChunkedHeadLoss(torch.autograd.Function):
    """The loss and, when a backward will follow, its gradients in the same pass over each chunk's logits.

    The gradient of the mean cross-entropy is ``(softmax - onehot) / denom`` per row, known as soon as a chunk's
    logits are: computing it there spares the backward a second head matmul per chunk (a quarter of the head's
    FLOPs) and a second softmax. The backward only scales the kept gradients by the incoming one.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, denom, autocast_dtype, with_grads):
        compute_dtype = autocast_dtype or hidden.dtype
        w = weight.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden) if with_grads and ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if with_grads and ctx.needs_input_grad[1] else None)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start : start + chunk_rows]
            tgt = targets[start : start + chunk_rows, None]
            logits = _logits(h, w, autocast_dtype)
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, tgt).squeeze(1)).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            probs = logits.sub_(lse[:, None]).exp_()  # the softmax, in the logits' own memory
            probs.scatter_add_(1, tgt, -torch.ones_like(probs[:, :1]))
            dlogits = probs.mul_(1.0 / denom).to(compute_dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + h.shape[0]] = (dlogits @ w).to(hidden.dtype)
            if grad_weight is not None:
                # the fp32 add reads the compute-dtype product as it is; a .float() copy would cost two more passes
                grad_weight.add_(dlogits.t() @ h.to(compute_dtype))
        ctx.grads = (grad_hidden, grad_weight) if with_grads else None
        ctx.weight_dtype = weight.dtype
        return total / denom

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("lazytrain's chunked loss was computed without grad mode, or its backward already ran "
                               "once: compute the loss again under grad mode for each backward")
        (grad_hidden, grad_weight), ctx.grads = ctx.grads, None
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _logits(h: torch.Tensor, weight: torch.Tensor, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    if autocast_dtype is not None:
        return (h.to(autocast_dtype) @ weight.to(autocast_dtype).t()).float()
    return (h @ weight.t()).float()


@torch.no_grad()
def chunked_token_accuracy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_bytes: int = 1 << 29
) -> torch.Tensor:
    """Teacher-forced next-token accuracy over the labelled positions, through the head in chunks (no logits kept)."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    rows = (shifted != IGNORE_INDEX).nonzero().squeeze(1)
    if rows.numel() == 0:
        return torch.zeros((), device=hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    targets = shifted.index_select(0, rows)
    chunk_rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    correct = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, flat.shape[0], chunk_rows):
        pred = (flat[start : start + chunk_rows] @ weight.to(flat.dtype).t()).argmax(-1)
        correct += (pred == targets[start : start + chunk_rows]).sum()
    return correct / rows.numel()


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_bytes: int = 1 << 30,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden @ weight.T`` against ``labels`` (B, T), HF's convention."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    rows = (shifted != IGNORE_INDEX).nonzero().squeeze(1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    selected = flat.index_select(0, rows)
    targets = shifted.index_select(0, rows)
    if rows.numel() == 0:
        # HF's mean over zero tokens is NaN; a zero loss with a zero gradient is what a user can train through.
        return hidden.sum() * 0.0 + weight.sum() * 0.0
    denom = float(num_items_in_batch) if num_items_in_batch is not None else float(rows.numel())
    device_type = hidden.device.type
    autocast_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    chunk_rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    with torch.autocast(device_type, enabled=False):
        return _ChunkedHeadLoss.apply(selected, weight, targets, chunk_rows, denom, autocast_dtype,
                                      torch.is_grad_enabled())
