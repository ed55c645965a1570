"""The backward's re-run of a layer skips its MLP's output projection.

A layer that re-runs in the backward runs its forward with grad only to rebuild the graph; its output is already
known (it is the next boundary, or the next layer's rebuilt input) and only its gradient is ever used. The one
matmul whose result nothing else in the graph reads is the MLP's ``down_proj``: it feeds the residual add alone,
whose backward needs no values. Its backward needs its input and weight, not its output. So in that re-run
``down_proj`` runs as ``GradientOnlyLinear``: it saves what the backward reads and returns a zero-strided
placeholder instead of multiplying. At Qwen2.5-7B's shape that is 28% of the re-run's FLOPs.

It applies where ``layer.mlp.down_proj`` is a plain ``nn.Linear`` with no hooks (a LoRA wrapper, a quantized
linear or a hook that reads the output keeps the full forward), in the families whose decoder layer adds the MLP's
output straight to the residual (every family in ``models.adapter``; `tests/test_engine_gradient_only_linear.py`
holds each to the plain backward). As with ``mlp_recompute``, the override lives on the instance for one call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class GradientOnlyLinear(torch.autograd.Function):
    """``F.linear``'s backward without its forward product; the output placeholder must not be read."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(x.to(dtype), weight.to(dtype))
        return x.new_zeros((), dtype=dtype).expand(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad = grad.to(x.dtype)
        flat_grad, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = grad.matmul(weight).to(x_dtype) if ctx.needs_input_grad[0] else None
        grad_w = flat_x.t().mm(flat_grad).t().to(w_dtype) if ctx.needs_input_grad[1] else None
        grad_b = flat_grad.sum(0).to(b_dtype) if b_dtype is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def skips_mlp_output(layer: nn.Module) -> bool:
    """Whether ``layer``'s re-run can run its MLP's output projection as ``GradientOnlyLinear``."""
    down = getattr(getattr(layer, "mlp", None), "down_proj", None)
    return (type(down) is nn.Linear and "forward" not in down.__dict__
            and not (down._forward_hooks or down._forward_pre_hooks))


def _gradient_only(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return GradientOnlyLinear.apply(x, self.weight, self.bias)


@contextlib.contextmanager
def mlp_output_skipped(layer: nn.Module) -> Iterator[None]:
    """Within this context a call of ``layer`` returns a placeholder output whose backward is exact; a layer that
    ``skips_mlp_output`` rejects runs unchanged."""
    if not skips_mlp_output(layer):
        yield
        return
    down = layer.mlp.down_proj
    down.forward = _gradient_only.__get__(down)
    try:
        yield
    finally:
        del down.forward
