"""The correctness check ``lora_gpu.py`` runs before its timings: a tiny peft model (LoRA over a full-precision
base, then over a bitsandbytes NF4 one), 3 steps under lazytrain and under plain Lightning on the same device,
data and AdamW, clipping on; the adapters' updates must agree and no frozen weight may move. A few seconds."""

from __future__ import annotations

import copy
import time

import lightning.pytorch as pl
import torch
from common import GPU
from lora_systems import TINY_SIZES
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen2Config

from lightning_lazytrain.models.quantize import mark_4bit, quantize_layers

# how far apart the two runs' adapter updates may be (relative): fp32 rounding on the CPU; on the GPU cuBLAS may
# pick other kernels for the streamed weights (tests/test_gpu_qlora.py)
TOLERANCE = 1e-3 if GPU else 1e-4
CLIP, STEPS = 0.05, 3


class _Module(pl.LightningModule):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)


def tiny_peft(quantize: str | None):
    torch.manual_seed(0)
    config = Qwen2Config(**TINY_SIZES)
    base = AutoModelForCausalLM.from_config(config)
    if quantize:
        quantize_layers(base.model.layers, quantize)
        mark_4bit(base)
    torch.manual_seed(1)  # B starts random: the first step already moves A
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(base, lora)


def _fit(model, strategy: str, data: list[dict]):
    module = _Module(copy.deepcopy(model))
    trainer = pl.Trainer(
        accelerator="gpu" if GPU else "cpu",
        devices=1,
        strategy=strategy,
        precision="32-true",
        max_steps=len(data),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        gradient_clip_val=CLIP,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    return module.model.cpu()


def _state(model, trained: bool) -> dict[str, torch.Tensor]:
    return {n: p.detach().double() for n, p in model.named_parameters() if p.requires_grad == trained}


def _update_diff(start, a, b) -> float:
    s0, sa, sb = _state(start, True), _state(a, True), _state(b, True)
    num = sum(float((sa[k] - sb[k]).square().sum()) for k in sb)
    den = sum(float((sb[k] - s0[k]).square().sum()) for k in sb)
    return (num / den) ** 0.5


def check() -> dict:
    """One entry per base kind: the adapters' relative update difference, whether the frozen base moved."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(STEPS):
        ids = torch.randint(0, 512, (2, 16), generator=gen)
        data.append({"input_ids": ids, "labels": ids})
    out: dict = {"tolerance": TOLERANCE, "steps": STEPS, "clip": CLIP, "device": "cuda" if GPU else "cpu"}
    ok = True
    for name, quantize in (("lora", None), ("qlora-nf4", "nf4")):
        model = tiny_peft(quantize)
        plain, lazy = _fit(model, "auto", data), _fit(model, "lazytrain", data)
        diff = _update_diff(model.cpu(), lazy, plain)
        frozen0, frozen = _state(model, False), _state(lazy, False)
        base_moved = any(not torch.equal(frozen[k], frozen0[k]) for k in frozen0)
        out[name] = {"adapter_update_rel_diff": diff, "frozen_base_moved": base_moved}
        ok = ok and diff <= TOLERANCE and not base_moved
    out["status"] = "ok" if ok else f"FAILED: lazytrain and plain Lightning disagree beyond {TOLERANCE}"
    out["wall_s"] = time.perf_counter() - start
    return out
