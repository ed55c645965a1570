"""Liger's fused Triton RMSNorm, SwiGLU and RoPE inside the streamed decoder layers.

HF's RMSNorm makes an fp32 copy of its input and five more passes over it, and the MLP writes ``act(gate)`` and the
product as two more intermediate-sized tensors; autograd keeps most of them. Liger-Kernel (the kernels TRL's and
axolotl's ``use_liger_kernel`` turn on) does each in one pass and keeps only the inputs (and one fp32 value per row
of a norm); its RoPE rotates q and k in place in one pass where HF writes several q- and k-sized temporaries. So a
layer's forward and backward run faster and its kept graph is smaller.

Only what the engine streams is changed, and only per instance: a ``forward`` bound method in the module's
``__dict__`` (bound, so that a ``copy.deepcopy`` of a layer, as the profiler makes, runs with its own weights). It
covers the norms, the MLP and the attention of each decoder layer, for the classes whose arithmetic Liger's "llama"
casting mode reproduces (``weight * (x * rsqrt(mean(x²) + eps)).to(dtype)``; a SiLU-gated MLP without bias; RoPE
over the whole head, ``rotate_half`` style). The final norm keeps
the engine's own override; classes, parameters and ``state_dict`` are untouched, and ``unfuse_decoder_kernels``
takes every override away again.

HF's attention applies RoPE through its modeling module's global ``apply_rotary_pos_emb``, which one instance cannot
own. The attention's bound forward therefore swaps that global for Liger's only while it runs its class's forward,
and puts HF's back in a ``finally``: other models of the class in the process (a reference model on the CPU, where
Triton cannot run) keep HF's, and so does everything outside the layer's call.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

#: RMSNorm classes computing ``weight * normalized.to(input dtype)`` with the weight applied as is (no ``1 + w``)
_PLAIN_NORMS = frozenset({"Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "LlamaRMSNorm"})
#: MLP classes computing ``down(silu(gate(x)) * up(x))``
_SWIGLU_MLPS = frozenset({"Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "LlamaMLP"})
#: attention classes rotating the whole head with ``rotate_half`` through their module's ``apply_rotary_pos_emb``
_ROPE_ATTENTIONS = frozenset({"Qwen2Attention", "Qwen3Attention", "Qwen3MoeAttention", "LlamaAttention"})
_ROPE_GLOBAL = "apply_rotary_pos_emb"
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


def _rope_kernel():
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    return liger_rotary_pos_emb


def _fused_attention(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    modeling = sys.modules[type(self).__module__]
    hf_rope = getattr(modeling, _ROPE_GLOBAL)
    setattr(modeling, _ROPE_GLOBAL, _rope_kernel())
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        setattr(modeling, _ROPE_GLOBAL, hf_rope)


def _is_rope_attention(module: nn.Module) -> bool:
    modeling = sys.modules.get(type(module).__module__)
    return type(module).__name__ in _ROPE_ATTENTIONS and callable(getattr(modeling, _ROPE_GLOBAL, None))


def _is_plain_norm(module: nn.Module) -> bool:
    return type(module).__name__ in _PLAIN_NORMS and getattr(module, "weight", None) is not None


def _is_swiglu(mlp: nn.Module) -> bool:
    if type(mlp).__name__ not in _SWIGLU_MLPS:
        return False
    silu = getattr(getattr(mlp, "config", None), "hidden_act", None) in ("silu", "swish")
    unbiased = all(getattr(getattr(mlp, n, None), "bias", 0) is None for n in ("gate_proj", "up_proj", "down_proj"))
    return silu and unbiased


class FusedParts(NamedTuple):
    norms: bool
    mlp: bool
    rope: bool


UNFUSED = FusedParts(False, False, False)

#: per part of ``FusedParts``, in its order: the name users read, which submodules match, what is bound to them
_BINDINGS = (("norm", _is_plain_norm, _fused_norm), ("SwiGLU", _is_swiglu, _fused_mlp),
             ("RoPE", _is_rope_attention, _fused_attention))


def fusable(layer: nn.Module) -> FusedParts:
    """Whether ``fuse_decoder_kernels`` would bind the layer's norms, its MLP and its attention's RoPE; reads
    classes and the config only, so a model on the meta device answers too."""
    modules = list(layer.modules())
    return FusedParts(*(any(matches(m) for m in modules) for _, matches, _ in _BINDINGS))


def fused_part_names(layers: Iterable[nn.Module]) -> list[str]:
    """The parts ``fuse_decoder_kernels`` would bind in any of ``layers``, by name ("norm", "SwiGLU", "RoPE")."""
    parts = [fusable(layer) for layer in layers]
    return [name for k, (name, _, _) in enumerate(_BINDINGS) if any(p[k] for p in parts)]


def fused_count(layers: Iterable[nn.Module]) -> int:
    """How many submodules of ``layers`` run Liger's kernels now."""
    return sum(bool(m.__dict__.get(_MARK)) for layer in layers for m in layer.modules())


def fuse_decoder_kernels(layers: Iterable[nn.Module]) -> int:
    """Binds Liger's RMSNorm, SwiGLU and RoPE onto the matching submodules of ``layers``; returns how many it bound.

    A submodule that already has an instance ``forward`` (someone else's override) is left as it is.
    """
    count = 0
    for layer in layers:
        for module in layer.modules():
            if "forward" in module.__dict__:
                continue
            forward = next((bound for _, matches, bound in _BINDINGS if matches(module)), None)
            if forward is None:
                continue
            module.forward = types.MethodType(forward, module)
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
