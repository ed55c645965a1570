"""Checkpoints of a run over a frozen base (LoRA): the trainable weights only, and a fingerprint of the base.

A LoRA run over a 27B base trains a few tens of millions of parameters; saving the base with every checkpoint
would write 50 GB for 0.1 GB of training state. The module's state dict is saved without the frozen parameters
(nor what a frozen parameter carries beside it: bitsandbytes' 4-bit quant state), the optimizer's state covers
the trainable parameters anyway, and ``checkpoint["lazytrain_base"]`` records which base it was trained over: a
hash of the frozen parameters' names and shapes, and one of a cheap sample of their values (at most
``SAMPLE_PER_TENSOR`` evenly spaced elements each, rounded to bf16 so a base held in fp32 or as its bf16 stream
copy gives the same sample). Loading checks both and names what differs, then loads the trainable weights into
the model, which already holds its base.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

BASE_KEY = "lazytrain_base"
SAMPLE_PER_TENSOR = 16


class BaseMismatchError(ValueError):
    """A trainable-only checkpoint is loaded over a different frozen base than the one it was trained over."""


def frozen_names(module: nn.Module) -> list[str]:
    """State-dict names of ``module``'s frozen parameters (every name of a tied one)."""
    return [n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]


def has_frozen_base(module: nn.Module) -> bool:
    return any(not p.requires_grad for p in module.parameters())


def _is_frozen_key(key: str, frozen: set[str]) -> bool:
    """``key`` is a frozen parameter or something saved beside it (``weight.absmax`` of a 4-bit weight)."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in frozen for i in range(1, len(parts) + 1))


def trainable_state(state: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """``state`` (``module.state_dict()``) without the frozen parameters and what they carry. A kept tensor that
    views a larger buffer (a unit's flat buffer, frozen weights included, under ``32-true``) is copied out:
    ``torch.save`` writes a view's whole storage."""
    frozen = set(frozen_names(module))
    return {k: _own(v) for k, v in state.items() if not _is_frozen_key(k, frozen)}


def _own(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.numel() * value.element_size():
        return value.clone()
    return value


def base_fingerprint(module: nn.Module) -> dict[str, Any]:
    """Which frozen base ``module`` holds: hashes of its frozen parameters' names and shapes, and of a sample."""
    layout, sample = hashlib.sha256(), hashlib.sha256()
    count = 0
    for name, param in module.named_parameters():
        if param.requires_grad:
            continue
        count += 1
        layout.update(f"{name}:{tuple(param.shape)};".encode())
        flat = param.detach().reshape(-1)
        if flat.numel():
            picks = torch.linspace(0, flat.numel() - 1, min(SAMPLE_PER_TENSOR, flat.numel())).long()
            sample.update(flat[picks].to(device="cpu", dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
    return {"frozen_tensors": count, "layout_sha256": layout.hexdigest(), "sample_sha256": sample.hexdigest()}


def check_base(saved: Mapping[str, Any], module: nn.Module, path: str) -> None:
    """Raise :class:`BaseMismatchError` when ``module``'s frozen base is not the one ``saved`` describes."""
    now = base_fingerprint(module)
    fix = ("resume with the base model the run started from (the same pretrained weights, target modules and"
           " LoRA rank), or train from the new base without ckpt_path")
    if saved["layout_sha256"] != now["layout_sha256"]:
        raise BaseMismatchError(
            f"{path} holds only the trainable weights of a run over a frozen base of {saved['frozen_tensors']}"
            f" tensors, and this model's frozen base ({now['frozen_tensors']} tensors) has other names or shapes:"
            f" {fix}")
    if saved["sample_sha256"] != now["sample_sha256"]:
        raise BaseMismatchError(
            f"{path} holds only the trainable weights of a run over a frozen base whose values differ from this"
            f" model's (same names and shapes, a different sample of values): {fix}")


def load_trainable_state(module: nn.Module, state: Mapping[str, Any], path: str) -> None:
    """Load a trainable-only state dict into ``module``: every trainable weight must be there, nothing else."""
    result = module.load_state_dict(dict(state), strict=False)
    frozen = set(frozen_names(module))
    missing = [k for k in result.missing_keys if not _is_frozen_key(k, frozen)]
    if missing or result.unexpected_keys:
        raise BaseMismatchError(
            f"{path} does not fit this model's trainable weights (missing {missing[:3]}, unexpected"
            f" {list(result.unexpected_keys)[:3]}): resume with the LoRA settings (rank, target modules) it was"
            " saved with")
