"""Causal-LM loss through the head in row chunks, so the batch x seq x vocab logits never exist at once.

Matches ``transformers``' ``ForCausalLMLoss``: labels shifted left by one, ``-100`` ignored, logits upcast to fp32,
mean over the counted tokens (or a sum divided by ``num_items_in_batch`` when given). Only the rows that carry a
label go through the head at all, which for supervised fine-tuning (loss on the response only) skips the prompt.
The backward recomputes each chunk's logits instead of keeping them.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
LOSS_CHUNK_BYTES = 1 << 29  # the executor's default: fp32 logits of at most this many bytes per chunk


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, denom, autocast_dtype):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_rows, ctx.denom, ctx.autocast_dtype = chunk_rows, denom, autocast_dtype
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            logits = _logits(hidden[start : start + chunk_rows], weight, autocast_dtype)
            tgt = targets[start : start + chunk_rows]
            total += (torch.logsumexp(logits, dim=-1) - logits.gather(1, tgt[:, None]).squeeze(1)).sum()
        return total / denom

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, targets = ctx.saved_tensors
        compute_dtype = ctx.autocast_dtype or hidden.dtype
        w = weight.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        scale = grad_loss / ctx.denom
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            h = hidden[start : start + ctx.chunk_rows]
            logits = _logits(h, weight, ctx.autocast_dtype)
            probs = torch.softmax(logits, dim=-1)
            probs.scatter_add_(1, targets[start : start + ctx.chunk_rows, None], -torch.ones_like(probs[:, :1]))
            dlogits = (probs * scale).to(compute_dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + h.shape[0]] = (dlogits @ w).to(hidden.dtype)
            grad_weight += (dlogits.t() @ h.to(compute_dtype)).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


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
        return _ChunkedHeadLoss.apply(selected, weight, targets, chunk_rows, denom, autocast_dtype)
