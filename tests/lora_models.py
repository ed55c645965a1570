"""Tiny peft-wrapped models and a LightningModule that optimizes only their adapters, for the LoRA tests."""

from __future__ import annotations

import torch
from helpers import LMModule, tiny_model
from peft import LoraConfig, get_peft_model

from lightning_lazytrain.optim import HybridAdamW


def tiny_lora(family: str = "qwen2", r: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0,
              random_b: bool = True):
    """A tiny model with LoRA on ``targets``. ``random_b``: B starts random, not zero, so the first step already
    moves A and the adapted model differs from its base (peft's ``init_lora_weights=False``)."""
    base = tiny_model(family, seed=seed)
    torch.manual_seed(seed + 1)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=not random_b)
    return get_peft_model(base, config)


def trainable_and_frozen(model: torch.nn.Module) -> tuple[int, int]:
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params if not p.requires_grad)


class AdapterModule(LMModule):
    """``LMModule`` whose optimizer gets only the parameters that train (as a LoRA recipe does)."""

    optimizer_cls: type = torch.optim.AdamW

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return self.optimizer_cls(trainable, lr=self.lr, weight_decay=0.01)


class HybridAdapterModule(AdapterModule):
    optimizer_cls = HybridAdamW
