"""Liger's fused Triton RMSNorm and SwiGLU inside the streamed decoder layers.

HF's RMSNorm makes an fp32 copy of its input and five more passes over it, and the MLP writes ``act(gate)`` and the
product as two more intermediate-sized tensors; autograd keeps most of them. Liger-Kernel (the kernels TRL's and
axolotl's ``use_liger_kernel`` turn on) does each in one pass and keeps only the inputs (and one fp32 value per row
of a norm). So a layer's forward and backward run faster and its kept graph is smaller.

Only what the engine streams is changed, and only per instance: a ``forward`` bound method in the module's
``__dict__`` (bound, so that a ``copy.deepcopy`` of a layer, as the profiler makes, runs with its own weights). It
covers the norms and the MLP of each decoder layer, for the classes whose arithmetic Liger's "llama" casting mode
reproduces (``weight * (x * rsqrt(mean(x²) + eps)).to(dtype)``; a SiLU-gated MLP without bias). The final norm keeps
the engine's own override; classes, parameters and ``state_dict`` are untouched, and ``unfuse_decoder_kernels``
takes every override away again. RoPE is left alone: HF applies it through a module-level function, which cannot
be changed for one model only.
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

#: RMSNorm classes computing ``weight * normalized.to(input dtype)`` with the weight applied as is (no ``1 + w``)
_PLAIN_NORMS = frozenset({"Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "LlamaRMSNorm"})
#: MLP classes computing ``down(silu(gate(x)) * up(x))``
_SWIGLU_MLPS = frozenset({"Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "LlamaMLP"})
_MARK = "_lazytrain_fused"


def liger_available() -> bool:
    """Whether ``liger-kernel`` and the Triton it runs on are importable (CUDA builds of torch bring Triton)."""
    return all(importlib.util.find_spec(name) is not None for name in ("liger_kernel", "triton"))


def _fused_norm(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_rms_norm

    eps = float(getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6)))
    # in_place=False: the norm's input gradient gets its own buffer instead of overwriting the incoming one
    return liger_rms_norm(hidden_states, self.weight, eps, 0.0, "llama", False)


def _fused_mlp(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_swiglu

    return self.down_proj(liger_swiglu(self.gate_proj(x), self.up_proj(x)))


def _is_plain_norm(module: nn.Module) -> bool:
    return type(module).__name__ in _PLAIN_NORMS and getattr(module, "weight", None) is not None


def _is_swiglu(mlp: nn.Module) -> bool:
    if type(mlp).__name__ not in _SWIGLU_MLPS:
        return False
    silu = getattr(getattr(mlp, "config", None), "hidden_act", None) in ("silu", "swish")
    unbiased = all(getattr(getattr(mlp, n, None), "bias", 0) is None for n in ("gate_proj", "up_proj", "down_proj"))
    return silu and unbiased


def fusable(layer: nn.Module) -> tuple[bool, bool]:
    """(norms, MLP): whether ``fuse_decoder_kernels`` would bind the layer's norms and its MLP; reads classes and
    the config only, so a model on the meta device answers too."""
    return any(_is_plain_norm(m) for m in layer.modules()), any(_is_swiglu(m) for m in layer.modules())


def fuses_any(layers: Iterable[nn.Module]) -> bool:
    """Whether ``fuse_decoder_kernels`` would bind anything in ``layers``."""
    return any(any(fusable(layer)) for layer in layers)


def fused_count(layers: Iterable[nn.Module]) -> int:
    """How many submodules of ``layers`` run Liger's kernels now."""
    return sum(bool(m.__dict__.get(_MARK)) for layer in layers for m in layer.modules())


def fuse_decoder_kernels(layers: Iterable[nn.Module]) -> int:
    """Binds Liger's RMSNorm and SwiGLU onto the matching submodules of ``layers``; returns how many it bound.

    A submodule that already has an instance ``forward`` (someone else's override) is left as it is.
    """
    count = 0
    for layer in layers:
        for module in layer.modules():
            if "forward" in module.__dict__:
                continue
            if _is_plain_norm(module):
                module.forward = types.MethodType(_fused_norm, module)
            elif _is_swiglu(module):
                module.forward = types.MethodType(_fused_mlp, module)
            else:
                continue
            setattr(module, _MARK, True)
            count += 1
    return count


def unfuse_decoder_kernels(layers: Iterable[nn.Module]) -> None:
    """Takes away every override ``fuse_decoder_kernels`` bound on ``layers``."""
    for layer in layers:
        for module in layer.modules():
            if module.__dict__.pop(_MARK, False):
                del module.forward


FusedKernels = Literal["auto", "liger", "none"]


def check_fused_kernels(mode: str) -> FusedKernels:
    if mode not in ("auto", "liger", "none"):
        raise ValueError(f"fused_kernels={mode!r}: choose 'auto', 'liger' or 'none'")
    return mode  # type: ignore[return-value]


def use_fused_kernels(mode: FusedKernels, device_type: str) -> bool:
    """Whether the streamed layers run Liger's kernels: ``"auto"`` when on CUDA with ``liger-kernel`` installed,
    ``"liger"`` always (an error where it cannot), ``"none"`` never."""
    check_fused_kernels(mode)
    usable = device_type == "cuda" and liger_available()
    if mode == "liger" and not usable:
        why = "the liger-kernel package is not installed" if device_type == "cuda" else f"the device is {device_type}"
        raise ValueError(f"fused_kernels='liger' needs a CUDA device and the liger-kernel package (with Triton), but "
                         f"{why}: `pip install liger-kernel` on a CUDA machine, or set fused_kernels='auto' or 'none'")
    return mode != "none" and usable
