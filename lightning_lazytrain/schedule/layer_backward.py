"""What a layer's backward computes and sends back, by which of its weights train (LoRA: the adapters only).

The backward of a matmul ``y = x W^T`` is the input gradient ``dx = dy W`` (2 FLOPs per weight and token) for
every weight, frozen or not, since the layers below still need it, and the weight gradient ``dW = dy^T x`` (2 more)
only for a weight that trains: autograd computes no gradient for one with ``requires_grad=False``, and the engine
asks for none (``engine/compute/stack.py``). The attention's token mixing has no weights; its backward is twice its
forward (the scores' and the values' gradients). So a layer whose weights all train costs twice its forward in
the backward, the factor the plan charged every layer before, and a frozen base layer (LoRA, QLoRA) a little over
once its forward, plus its adapters' weight gradients. Only the trainable weights' gradients go back to the host.

A bitsandbytes 4-bit weight counts its unpacked shape in FLOPs (bitsandbytes dequantizes it and multiplies in
bf16) and its packed codes and quant state in streamed bytes, as the store lays the unit out
(``engine/weights/layout.py``).
"""

from __future__ import annotations

from torch import nn

from lightning_lazytrain.engine.weights.layout import collect_entries

#: a layer's backward over its forward when all its weights train (its attention's mixing is twice its forward too)
FULL_BACKWARD_FACTOR = 2.0


def _distinct(module: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())


def _matmul_numel(param: nn.Parameter) -> int:
    state = getattr(param, "quant_state", None)
    return int(state.shape.numel()) if getattr(param, "bnb_quantized", False) and state is not None else param.numel()


def flop_numel(module: nn.Module) -> int:
    """Weights ``module``'s forward multiplies by: each distinct parameter once, a 4-bit one at its unpacked size."""
    return sum(_matmul_numel(p) for p in _distinct(module))


def trained_numel(module: nn.Module) -> int:
    """Parameters of ``module`` that train (``requires_grad``), a tied one once."""
    return sum(p.numel() for p in _distinct(module) if p.requires_grad)


def backward_flops(weights: int, trained: int, mixing_flops: float, tokens: int) -> float:
    """FLOPs of one layer's backward for ``tokens`` tokens: input gradients through all ``weights``, weight
    gradients of the ``trained`` ones, and twice the forward's token mixing (``mixing_flops``)."""
    return 2.0 * weights * tokens + 2.0 * trained * tokens + 2.0 * mixing_flops


def backward_ratio(layer: nn.Module, mixing_flops: float, tokens: int) -> float:
    """``layer``'s backward seconds per second of its forward (``2 numel tokens + mixing_flops`` FLOPs), at the
    same achieved rate: 2 when every weight trains."""
    weights = flop_numel(layer)
    forward = 2.0 * weights * tokens + mixing_flops
    if forward <= 0:
        return FULL_BACKWARD_FACTOR
    return backward_flops(weights, trained_numel(layer), mixing_flops, tokens) / forward


def streamed_bytes(layer: nn.Module, itemsize: int) -> int:
    """Bytes of ``layer``'s unit as the store streams it in a dtype of ``itemsize``: its parameters, a 4-bit
    weight as its packed codes and quant state (16-byte aligned)."""
    return collect_entries([layer], itemsize)[2] * itemsize
