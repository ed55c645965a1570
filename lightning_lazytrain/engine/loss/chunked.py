"""Causal-LM loss through the head in row chunks, so the batch x seq x vocab logits never exist at once.

Matches ``transformers``' ``ForCausalLMLoss``: labels shifted left by one, ``-100`` ignored, logits upcast to fp32,
mean over the counted tokens (or a sum divided by ``num_items_in_batch`` when given). Only the rows that carry a
label go through the head at all, which for supervised fine-tuning (loss on the response only) skips the prompt.
Under grad mode each chunk's gradients are computed with its loss (``_ChunkedHeadLoss``), so no logits are kept
and none are computed twice. On CUDA with Triton, one kernel (``kernel.py``) does a chunk's softmax over the
logits in their own dtype and cuBLAS adds each chunk's weight gradient into the fp32 sum; elsewhere torch ops do
both over fp32 logits.
"""

from __future__ import annotations

import importlib.util

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
LOSS_CHUNK_BYTES = 1 << 29  # the executor's default: a chunk's logits (fp32, or the kernel's dtype) in bytes


class _ChunkedHeadLoss(torch.autograd.Function):
    """The loss and, when a backward will follow, its gradients in the same pass over each chunk's logits.

    The gradient of the mean cross-entropy is ``(softmax - onehot) / denom`` per row, known as soon as a chunk's
    logits are: computing it there spares the backward a second head matmul per chunk (a quarter of the head's
    FLOPs) and a second softmax. The backward only scales the kept gradients by the incoming one.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, denom, autocast_dtype, with_grads, kernel):
        compute_dtype = autocast_dtype or hidden.dtype
        w = weight.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden) if with_grads and ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if with_grads and ctx.needs_input_grad[1] else None)
        wants_grads = grad_hidden is not None or grad_weight is not None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        if kernel:
            from lightning_lazytrain.engine.loss.kernel import row_loss_and_grad_
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start : start + chunk_rows].to(compute_dtype)
            tgt = targets[start : start + chunk_rows]
            if kernel:
                dlogits = h @ w.t()
                total += row_loss_and_grad_(dlogits, tgt, 1.0 / denom, wants_grads).sum()
            else:
                chunk_loss, dlogits = _torch_loss_and_grad(h, w, tgt[:, None], denom, autocast_dtype, wants_grads)
                total += chunk_loss
            if grad_hidden is not None:
                grad_hidden[start : start + h.shape[0]] = (dlogits @ w).to(hidden.dtype)
            if grad_weight is not None:
                _add_weight_grad(grad_weight, dlogits, h)
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
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _torch_loss_and_grad(h: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor, denom: float,
                         autocast_dtype: torch.dtype | None,
                         wants_grads: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunk's summed loss, and its logits gradient in the compute dtype (None without ``wants_grads``)."""
    logits = _logits(h, w, autocast_dtype)
    lse = torch.logsumexp(logits, dim=-1)
    chunk_loss = (lse - logits.gather(1, tgt).squeeze(1)).sum()
    if not wants_grads:
        return chunk_loss, None
    probs = logits.sub_(lse[:, None]).exp_()  # the softmax, in the logits' own memory
    probs.scatter_add_(1, tgt, -torch.ones_like(probs[:, :1]))
    return chunk_loss, probs.mul_(1.0 / denom).to(h.dtype)


def _add_weight_grad(grad_weight: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_weight += dlogits.T @ h`` into the fp32 sum: on CUDA inside the GEMM (its epilogue reads and writes
    the sum once), elsewhere by adding the product as it is (a .float() copy of it would cost two more passes)."""
    if not h.is_cuda or dlogits.dtype == torch.float64:
        grad_weight.add_(dlogits.t() @ h)
    elif dlogits.dtype == torch.float32:
        grad_weight.addmm_(dlogits.t(), h)
    else:
        torch.addmm(grad_weight, dlogits.t(), h, out_dtype=torch.float32, out=grad_weight)


def _logits(h: torch.Tensor, weight: torch.Tensor, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    if autocast_dtype is not None:
        return (h.to(autocast_dtype) @ weight.to(autocast_dtype).t()).float()
    return (h @ weight.t()).float()


def triton_available() -> bool:
    """Whether Triton is importable (CUDA builds of torch bring it), and with it ``kernel.py``."""
    return importlib.util.find_spec("triton") is not None


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
    kernel: bool | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden @ weight.T`` against ``labels`` (B, T), HF's convention.

    ``chunk_bytes`` bounds a chunk's logits (fp32 for the torch ops, the compute dtype for the kernel); ``kernel``:
    the Triton kernel of ``kernel.py`` (None: on CUDA where Triton is importable)."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    rows = (shifted != IGNORE_INDEX).nonzero().squeeze(1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    selected = flat.index_select(0, rows)
    targets = shifted.index_select(0, rows)
    if rows.numel() == 0:
        # HF's mean over zero tokens is NaN; a zero loss with a zero gradient is what a user can train through.
        return hidden.sum() * 0.0 + weight.sum() * 0.0
    vocab = weight.shape[0]
    outside = targets[(targets < 0) | (targets >= vocab)]
    if outside.numel():
        raise ValueError(f"label {int(outside[0])} is outside the head's vocabulary of {vocab} tokens: labels are "
                         f"token ids below {vocab}, or {IGNORE_INDEX} for positions without a loss")
    denom = float(num_items_in_batch) if num_items_in_batch is not None else float(rows.numel())
    device_type = hidden.device.type
    autocast_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    if kernel is None:
        kernel = device_type == "cuda" and triton_available()
    if kernel and device_type != "cuda":
        raise ValueError(f"the loss kernel runs on CUDA only; the head is on {device_type}")
    logits_itemsize = (autocast_dtype or hidden.dtype).itemsize if kernel else 4
    chunk_rows = max(1, chunk_bytes // (logits_itemsize * vocab))
    with torch.autocast(device_type, enabled=False):
        return _ChunkedHeadLoss.apply(selected, weight, targets, chunk_rows, denom, autocast_dtype,
                                      torch.is_grad_enabled(), kernel)
