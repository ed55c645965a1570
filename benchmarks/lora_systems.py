"""The systems of the LoRA / QLoRA benchmark (``lora_gpu.py``): one peft model over a frozen base, trained by
lazytrain, by Lightning's DeepSpeed ZeRO-3 offload and by plain Lightning, with the recipe's settings.

What a row takes from its recipe (``recipes/qwen3.6-27b-lora.yaml``, ``recipes/qwen2.5-72b-qlora.yaml``): the
``lora:`` block (r, alpha, dropout, targets, quantize), the precision, the clip, and AdamW's lr, betas, eps and
weight decay; lazytrain runs the recipe's HybridAdamW, DeepSpeed its DeepSpeedCPUAdam, plain Lightning torch
AdamW on the GPU, each over the adapters only. Model FLOPs are the library's LoRA convention
(``schedule.analytic.model_flops_per_step``): 4 per frozen and 6 per trained parameter a token, plus
12 * layers * hidden * seq, counted on the meta model with the same adapters (a 4-bit weight counts its logical
size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import lightning.pytorch as pl
import torch
import yaml
from common import GPU
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.models.layerwise import build_quantized
from lightning_lazytrain.schedule.analytic import model_flops_per_step
from lightning_lazytrain.sft.lora import LoraOptions, add_adapters
from lightning_lazytrain.sft.plan_model import meta_model, model_config
from lightning_lazytrain.sft.recipes import recipe_path

SYSTEMS = ("lazytrain", "deepspeed-z3-offload", "plain")
# each benchmarked model: its recipe and the library's named shape (random init), and the tiny stand-in of the
# same family for the CPU dry run
MODELS = {
    "lora-27b": ("qwen3.6-27b-lora", "qwen3.6-27b"),
    "qlora-72b": ("qwen2.5-72b-qlora", "qwen2.5-72b"),
}
TINY_SIZES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TINY = {
    "lora-27b": dict(
        model_type="qwen3_5_text",
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        **TINY_SIZES,
    ),
    "qlora-72b": dict(model_type="qwen2", **TINY_SIZES),
}
DTYPE = torch.bfloat16  # both recipes' model.dtype


@dataclass
class Recipe:
    lora: LoraOptions
    precision: str
    clip: float
    adamw: dict  # lr, betas, eps, weight_decay
    hybrid: dict = field(default_factory=dict)  # HybridAdamW's own options (eight_bit_fraction, block_size)


def recipe(model: str) -> Recipe:
    with open(recipe_path(MODELS[model][0])) as f:
        cfg = yaml.safe_load(f)
    m, trainer = cfg["model"], cfg["trainer"]
    adamw = {"lr": m["lr"], "betas": tuple(m["betas"]), "eps": m["eps"], "weight_decay": m["weight_decay"]}
    return Recipe(
        LoraOptions(**m["lora"]),
        trainer["precision"],
        trainer["gradient_clip_val"],
        adamw,
        dict(m.get("optimizer_kwargs") or {}),
    )


def config_for(model: str, tiny: bool) -> PretrainedConfig:
    if tiny:
        fields = dict(TINY[model])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    return model_config(None, MODELS[model][1], False)[0]


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def flop_counts(config: PretrainedConfig, lora: LoraOptions, seq: int) -> dict:
    """Parameters (all, trained) of the model with its adapters and its model FLOPs a token, on the meta device."""
    model = add_adapters(meta_model(config), replace(lora, quantize="none"))
    params = list({id(p): p for p in model.parameters()}.values())
    total, trained = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    text = text_config(config)
    per_seq = model_flops_per_step(
        total, text.num_hidden_layers, text.hidden_size, 1, seq, frozen_params=total - trained
    )
    return {"params": total, "trainable_params": trained, "flops_per_token": per_seq / seq}


def base_model(config: PretrainedConfig, lora: LoraOptions, gradient_checkpointing: bool = False):
    """The random-init base in the recipe's dtype, built on the GPU where there is one (minutes faster than on the
    host): a bf16 base stays there (the caller moves it), a 4-bit one is built layer by layer and held on the host
    (``build_quantized(device=...)``)."""
    torch.manual_seed(0)
    if lora.quantize != "none":
        model = build_quantized(config, lora.quantize, DTYPE, device="cuda" if GPU else "cpu")
    else:
        with torch.device("cuda" if GPU else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPE, attn_implementation="sdpa")
    if gradient_checkpointing:  # non-reentrant: the frozen embedding's output needs no grad for the adapters' one
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class LoraModule(pl.LightningModule):
    """Trains ``model``'s adapters with ``optimizer`` (``hybrid``, ``deepspeed`` or ``adamw``); ``build`` makes the
    model in ``configure_model`` instead (under DeepSpeed's zero.Init there)."""

    def __init__(self, model, optimizer: str, rec: Recipe, build=None) -> None:
        super().__init__()
        self.model, self.optimizer_name, self.rec, self.build = model, optimizer, rec, build

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.build()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "hybrid":
            from lightning_lazytrain.optim import HybridAdamW

            return HybridAdamW(params, **self.rec.hybrid, **self.rec.adamw)
        if self.optimizer_name == "deepspeed":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(params, **self.rec.adamw)
        return torch.optim.AdamW(params, **self.rec.adamw)


@dataclass
class LoraRun:
    module: LoraModule
    strategy: Callable[[int], object]  # a fresh strategy for a fit at this batch (the module is kept between fits)
    precision: str
    optimizer: str
    note: str = ""


def build(system: str, config: PretrainedConfig, rec: Recipe) -> LoraRun:
    """``system``'s module and strategy for the peft model of ``config`` with the recipe's adapters."""
    lora = rec.lora
    if system == "lazytrain":
        base = base_model(config, lora).to("cpu")  # lazytrain takes the base in host memory
        if GPU:
            torch.cuda.empty_cache()
        return LoraRun(
            LoraModule(add_adapters(base, lora), "hybrid", rec),
            lambda batch: LazyTrainStrategy(schedule="milp"),
            rec.precision,
            f"HybridAdamW {rec.hybrid}",
            "schedule='milp'",
        )
    if system == "plain":  # everything on the GPU, no activation checkpointing: the peft model as a user has it
        model = add_adapters(base_model(config, lora), lora)
        return LoraRun(LoraModule(model, "adamw", rec), lambda batch: "auto", rec.precision, "torch AdamW (GPU)")
    if system == "deepspeed-z3-offload":
        return _deepspeed(config, rec)
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


def _deepspeed(config: PretrainedConfig, rec: Recipe) -> LoraRun:
    """ZeRO-3 with parameters and optimizer offloaded to the CPU, as DeepSpeed's offload docs advise (pinned host
    buffers, the model built under zero.Init in ``configure_model``, optimizer steps in sub-groups), with HF
    activation checkpointing. zero.Init cannot quantize, so a 4-bit base is built beforehand (on the host) and
    handed over as it is."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    lora = rec.lora

    def strategy(batch: int) -> DeepSpeedStrategy:
        return DeepSpeedStrategy(
            stage=3,
            offload_optimizer=True,
            offload_parameters=True,
            pin_memory=True,
            sub_group_size=int(1e9),
            logging_batch_size_per_gpu=batch,
        )

    note = "pin_memory=True, sub_group_size=1e9, HF checkpointing (non-reentrant)"
    if lora.quantize != "none":
        model = add_adapters(base_model(config, lora, gradient_checkpointing=True), lora)
        return LoraRun(
            LoraModule(model, "deepspeed", rec),
            strategy,
            rec.precision,
            "DeepSpeedCPUAdam",
            note + ", the 4-bit model built before the strategy",
        )

    def zero_init_build():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE, attn_implementation="sdpa")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return add_adapters(model, lora)

    return LoraRun(
        LoraModule(None, "deepspeed", rec, zero_init_build),
        strategy,
        rec.precision,
        "DeepSpeedCPUAdam",
        note + ", zero.Init via configure_model",
    )
