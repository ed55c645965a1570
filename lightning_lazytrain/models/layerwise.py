"""Build a 4-bit (QLoRA) causal LM without ever holding its whole full-precision base.

The model is made on the meta device (shapes, no memory). Each decoder layer is then materialised on the CPU, filled
from the checkpoint's safetensors shards or by the model's own ``_init_weights`` (random init), and quantized at
once (``quantize.py``), so one layer's full-precision weights exist at a time; the embedding, final norm, rotary
tables and head are materialised the same way and keep the model's dtype. For Qwen2.5-72B that is 1.9 GB of bf16
at a time instead of 145 GB.

``device="cuda"`` materialises and quantizes each layer on the GPU instead (bitsandbytes' CUDA kernels) and moves
the packed result to the host, where the model is held either way: for Qwen2.5-72B, random init and NF4
quantization took 54.6 s a layer on 2 CPU cores (about 70 minutes for the 80 layers), a few seconds on a GPU. The
GPU holds one full-precision layer at a time. Random init there draws from CUDA's generator, so its weights differ
from the CPU build's (the same distribution).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lightning_lazytrain.models.adapter import adapter_for
from lightning_lazytrain.models.quantize import QuantType, mark_4bit, quantize_layer

_INDEX = "model.safetensors.index.json"


class ShardReader:
    """The tensors of a directory of safetensors shards, read by name (one open file per shard)."""

    def __init__(self, directory: str) -> None:
        from safetensors import safe_open

        index = os.path.join(directory, _INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{directory} holds no .safetensors weights (nor {_INDEX})")
        self._files = [safe_open(os.path.join(directory, n), framework="pt") for n in files]
        self._where = {key: f for f in self._files for key in f.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)


def _own_modules(root: nn.Module, skip: set[int]) -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, module) of ``root``'s modules outside the subtrees whose ids are in ``skip``."""
    stack = [("", root)]
    while stack:
        prefix, module = stack.pop()
        yield prefix, module
        for name, child in module.named_children():
            if id(child) not in skip:
                stack.append((f"{prefix}.{name}" if prefix else name, child))


def _materialise(model: PreTrainedModel, modules: list[tuple[str, nn.Module]], shards: ShardReader | None,
                 device: torch.device) -> None:
    """Give ``modules`` (each on its own, not their children) memory on ``device`` and their weights: the
    checkpoint's tensor of the same name, else the model's own initialisation."""
    for _, module in modules:
        module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for prefix, module in modules:
            if shards is None:
                model._init_weights(module)
                continue
            for name, param in module.named_parameters(recurse=False):
                key = f"{prefix}.{name}" if prefix else name
                if not shards.has(key):
                    raise KeyError(f"the checkpoint has no tensor {key!r} for {type(model).__name__}")
                param.copy_(shards.get(key).to(param.dtype))
            if not any(True for _ in module.parameters(recurse=False)):
                model._init_weights(module)  # buffers only (rotary tables): computed, never saved


def _to_host(modules: list[tuple[str, nn.Module]]) -> None:
    """Move ``modules``' own parameters and buffers (not their children's) to the CPU; the 4-bit weights are there
    already (``quantized_linear``)."""
    for _, module in modules:
        module._apply(lambda t: t if t.device.type == "cpu" else t.cpu(), recurse=False)  # as to_empty does


def _build_device(device: str | torch.device) -> torch.device:
    """``device`` for the layer-by-layer build, refused at once where it cannot be used."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"build_quantized(device={str(device)!r}): CUDA is not available here; build on the CPU"
                         " (device='cpu', the default)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"build_quantized(device={str(device)!r}): layers are built on 'cpu' or 'cuda'")
    return device


def build_quantized(config: PretrainedConfig, quant_type: QuantType, dtype: torch.dtype,
                    weights_dir: str | None = None, trust_remote_code: bool = False,
                    attn_implementation: str | None = "sdpa", device: str | torch.device = "cpu") -> PreTrainedModel:
    """The causal LM of ``config`` with its decoder layers' linear layers 4-bit, built layer by layer, on the host.

    ``weights_dir``: a directory of safetensors shards (a hub snapshot); None builds random weights. Computes in
    ``dtype``, the dtype of everything not quantized. ``device``: where each layer is materialised and quantized
    before it is moved to the host (``"cuda"``: bitsandbytes' CUDA kernels, one layer's full precision on the GPU
    at a time).
    """
    device = _build_device(device)
    attn = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code, **attn)
    shards = ShardReader(weights_dir) if weights_dir is not None else None
    layers = list(adapter_for(model).layers)
    named = dict((id(m), n) for n, m in model.named_modules())
    for layer in layers:
        prefix = named[id(layer)]
        modules = [(f"{prefix}.{n}" if n else prefix, m) for n, m in layer.named_modules()]
        _materialise(model, modules, shards, device)
        quantize_layer(layer, quant_type, compute_dtype=dtype)
        if device.type != "cpu":
            _to_host(list(layer.named_modules()))
    rest = list(_own_modules(model, {id(layer) for layer in layers}))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    rest = [(n, m) for n, m in rest if not (tied and m is head)]
    _materialise(model, rest, shards, device)
    if device.type != "cpu":
        _to_host(rest)
    if tied:
        head.weight = model.get_input_embeddings().weight
    mark_4bit(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{type(model).__name__}: {left[0]} was not materialised by the layer-by-layer build")
    return model.train()
