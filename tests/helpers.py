"""Tiny models, data and a LightningModule shared by the strategy tests."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 512
FAMILIES = ["qwen2", "qwen2-tied", "qwen3", "qwen3-moe", "qwen3.5", "llama"]
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2,
)
_LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)


def tiny_config(family: str, **overrides):
    if family == "qwen2":
        cfg = Qwen2Config(**_COMMON)
    elif family == "qwen2-tied":
        cfg = Qwen2Config(**_COMMON, tie_word_embeddings=True)
    elif family == "qwen3":
        cfg = Qwen3Config(**_COMMON, head_dim=16)
    elif family == "qwen3-moe":
        cfg = Qwen3MoeConfig(**_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    elif family == "qwen3.5":
        cfg = Qwen3_5TextConfig(**_COMMON, head_dim=16, **_LINEAR)
    elif family == "llama":
        cfg = LlamaConfig(**_COMMON)
    else:
        raise KeyError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, **overrides))


def batches(n: int, batch: int = 2, seq: int = 16, seed: int = 1, padded: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
        labels = ids.clone()
        labels[:, : seq // 4] = -100
        item = {"input_ids": ids, "labels": labels}
        if padded:
            mask = torch.ones_like(ids)
            mask[0, -seq // 4 :] = 0
            labels[0, -seq // 4 :] = -100
            item["attention_mask"] = mask
        out.append(item)
    return out


class LMModule(pl.LightningModule):
    def __init__(self, model, lr: float = 1e-3, manual: bool = False, clip: float | None = None) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.automatic_optimization = not manual
        self.clip = clip
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            if self.clip:
                self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
            opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.val_losses.append(float(loss))
        self.log("val_loss", loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def train(model, data, strategy="auto", precision="32-true", max_steps=3, manual=False, clip=None, accelerator="cpu",
          module_cls=None, lr=1e-3, **trainer_kw):
    module = (module_cls or LMModule)(copy.deepcopy(model), lr=lr, manual=manual, clip=clip)
    trainer = pl.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, precision=precision, max_steps=max_steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        **{"enable_checkpointing": False, **trainer_kw},
    )
    trainer.fit(module, train_dataloaders=loader(data))
    return module, trainer


def loader(data):
    return torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)


def rel_diff(a: torch.nn.Module, b: torch.nn.Module, skip: dict[str, torch.Tensor] | None = None) -> float:
    """||a - b|| / ||b|| over all weights at once; elements where ``skip`` (from :meth:`GradRecorder.undecided`) is
    True are left out of the numerator.

    Per tensor is the wrong measure after AdamW steps: a tensor whose true gradient is ~0 (k_proj.bias: softmax
    ignores a per-key shift) gets sign-like +-lr updates from rounding noise in either run.
    """
    sa, sb = a.state_dict(), b.state_dict()
    num = sum(float(_kept(sa[k].double() - sb[k].double(), skip, k).square().sum()) for k in sb)
    den = sum(float(sb[k].double().square().sum()) for k in sb)
    return (num / den) ** 0.5


def update_rel_diff(start: torch.nn.Module, a: torch.nn.Module, b: torch.nn.Module,
                    skip: dict[str, torch.Tensor] | None = None) -> float:
    """||(a - start) - (b - start)|| / ||b - start||: how far apart the two runs' total updates are."""
    s0, sa, sb = start.state_dict(), a.state_dict(), b.state_dict()
    num = sum(float(_kept(sa[k].double() - sb[k].double(), skip, k).square().sum()) for k in sb)
    den = sum(float((sb[k].double() - s0[k].double()).square().sum()) for k in sb)
    return (num / den) ** 0.5


def _kept(diff: torch.Tensor, skip: dict[str, torch.Tensor] | None, key: str) -> torch.Tensor:
    if skip is None or key not in skip:
        return diff
    return diff.masked_fill(skip[key], 0.0)


class GradRecorder(pl.Callback):
    """The gradients (before clipping) and their global norm at each optimizer step of a run with ``.grad``."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        named = pl_module.model.named_parameters(remove_duplicate=False)
        self.grads.append({n: p.grad.detach().clone() for n, p in named if p.grad is not None})
        unique = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.stack([g.double().norm() for g in unique]).norm()))

    def undecided(self, rel: float = 1e-5) -> dict[str, torch.Tensor]:
        """Per weight, True where some step's gradient was nonzero but within ``rel`` of its tensor's largest.

        Such a gradient is zero up to rounding, and AdamW turns it into a +-lr move whose sign the rounding picks
        (its first update is lr * g / (|g| + eps) for any scale of g): one embedding element of the tiny Qwen3.5
        moved +5.9e-4 in one run and -4.4e-4 in another whose start weights differed by one ulp, 7e-5 of the
        global difference alone. Everything else must still match; callers check the set stays small.
        """
        out: dict[str, torch.Tensor] = {}
        for step in self.grads:
            for name, g in step.items():
                near_zero = (g != 0) & (g.abs() <= rel * g.abs().max())
                out[name] = out[name] | near_zero if name in out else near_zero
        return out


@contextlib.contextmanager
def small_tmpfs(mnt: Path, nbytes: int) -> Iterator[Path]:
    """A tmpfs of ``nbytes`` mounted at ``mnt`` for disk-full tests (root with CAP_SYS_ADMIN only: skipped
    elsewhere); unmounted afterwards unless the test did."""
    mnt.mkdir(exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot build a small file system for the disk-full test")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes // 1024}k", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root with CAP_SYS_ADMIN ({proc.stderr.strip()})")
    try:
        yield mnt
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["umount", str(mnt)], check=True)
