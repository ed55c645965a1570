"""A chunk's cross-entropy and its logits gradient in one Triton kernel, on CUDA, over the logits in place.

The torch ops of ``chunked.py`` make an fp32 copy of each chunk's logits and pass over it nine times (the copy, the
four passes of ``logsumexp``, the shift, the exp, the scale, the cast back). This kernel reads the logits twice in
their own dtype and writes the gradient once over them: a row's log-sum-exp by an online max and sum in fp32, then
``(exp(logit - lse) - onehot) * scale`` in the order ``chunked.py`` computes it, rounded once to the logits' dtype.
At the 7B head (152064 rows) and batch 192 x 1024 on an H100, the torch ops' elementwise kernels were busy 1.19 s
of the head's 2.16 s (``benchmarks/results/archive/trace_phases_7b_b192_f3994ed_cpu2.json``). Imported only where
Triton is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 16384  # columns per loop step: 16 fp32 values a thread at 32 warps


@triton.jit
def _row_loss_and_grad(x_ptr, stride, target_ptr, loss_ptr, n_cols, scale,
                       BLOCK: tl.constexpr, WITH_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride
    target = tl.load(target_ptr + row)
    target_logit = tl.load(x_row + target).to(tl.float32)
    top = float("-inf")
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, axis=0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        top = new_top
    lse = top + tl.log(total)
    tl.store(loss_ptr + row, lse - target_logit)
    if WITH_GRAD:
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse)
            grad = tl.where(cols == target, grad - 1.0, grad) * scale
            tl.store(x_row + cols, grad.to(x_ptr.dtype.element_ty), mask=mask)


def row_loss_and_grad_(logits: torch.Tensor, targets: torch.Tensor, scale: float, with_grad: bool) -> torch.Tensor:
    """Each row's ``logsumexp(logits) - logits[target]`` in fp32; with ``with_grad``, ``logits`` is overwritten by
    ``(softmax - onehot(target)) * scale``. ``logits``: contiguous (rows, vocab) on CUDA; ``targets``: (rows,) ids
    inside the vocabulary (the caller checks)."""
    if not logits.is_contiguous() or logits.dim() != 2:
        raise ValueError("the chunk's logits must be one contiguous (rows, vocab) tensor")
    rows, cols = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return losses
    block = min(MAX_BLOCK, triton.next_power_of_2(cols))
    _row_loss_and_grad[(rows,)](logits, logits.stride(0), targets.contiguous(), losses, cols, scale,
                                BLOCK=block, WITH_GRAD=with_grad, num_warps=max(1, min(32, block // 512)))
    return losses
