"""`CausalLMModule`: the recipe LightningModule — an HF causal LM, AdamW + warm-up/cosine, exact-match validation.

It follows the contract the lazytrain strategy relies on: the module holds one ``transformers.PreTrainedModel`` as
``self.model``, the loss comes from ``self.model(**model_inputs(batch)).loss`` (ids, labels, and the padding mask or a
packed batch's positions) and generation goes through ``self.model.generate``; it never reaches into the decoder
layers, so any Lightning strategy runs it.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_lazytrain.sft.data.answers import answers_match
from lightning_lazytrain.sft.data.collate import model_inputs
from lightning_lazytrain.sft.data.examples import IGNORE_INDEX
from lightning_lazytrain.sft.data.tokenizer import end_of_turn_id, load_tokenizer
from lightning_lazytrain.sft.eval_prompts import EvalPrompts, new_token_count
from lightning_lazytrain.sft.lora import LoraOptions, add_adapters, check_lora, layer_build_device
from lightning_lazytrain.sft.model_loading import (
    NAMED_SHAPES,
    DTypeName,
    build_model,
    build_quantized_model,
    check_sequence_length,
    check_source,
    sequence_source,
)

__all__ = ["NAMED_SHAPES", "CausalLMModule", "build_model", "warmup_cosine"]

def _import_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"optimizer must be a dotted class path such as 'torch.optim.AdamW', got {path!r}")
    return getattr(importlib.import_module(module), name)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warm-up from ~0 to 1 over ``warmup_steps``, then cosine down to ``min_lr_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CausalLMModule(pl.LightningModule):
    """Supervised fine-tuning of one HF causal LM, with held-out exact match of greedy answers.

    Args:
        pretrained: hub name or local directory of weights (``from_pretrained``); for a hub name ``revision`` (branch,
            tag or commit), ``cache_dir`` (the hub cache) and ``local_files_only`` (no network) are passed on.
            ``trust_remote_code`` runs code the model repository ships: off unless asked.
        model_config: for a random-init run instead: a config dict with ``model_type``, a name from
            :data:`NAMED_SHAPES`, or a config path.
        tokenizer: tokenizer name/path used when the datamodule provides none (``None``: the offline Qwen one).
        dtype: parameter dtype at load (``"auto"`` keeps the checkpoint's). Mixed precision is the Trainer's job.
        optimizer: dotted class path of a ``torch.optim.Optimizer`` taking ``lr``/``betas``/``eps``/``weight_decay``.
        optimizer_kwargs: extra keyword arguments for it (e.g. ``eight_bit_fraction`` for ``HybridAdamW``).
        warmup_steps / warmup_ratio: linear warm-up length in optimizer steps, or as a share of the whole run.
        min_lr_ratio: cosine floor as a fraction of ``lr``; ``scheduler="constant"`` keeps ``lr`` after warm-up.
        max_new_tokens: generation cap per held-out prompt; ``max_generate_samples`` caps prompts per evaluation
            (``0`` turns generation off, leaving loss and token accuracy). The evaluation's prompts are gathered
            and decoded together at its end, ``generate_batch_size`` at a time (``None``: all in one call, which
            lazytrain splits by device memory; set it under strategies that do not).
        lora: LoRA adapters over the frozen model (``sft/lora.py``; ``--model.lora.r 16``); ``None`` trains all
            of it. A 4-bit base (``lora.quantize``) is built on ``lora.build_device`` (``auto``: the run's GPU).
    """

    def __init__(
        self,
        pretrained: str | None = None,
        model_config: dict[str, Any] | str | None = None,
        tokenizer: str | None = None,
        dtype: DTypeName | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = "sdpa",
        revision: str | None = None,
        cache_dir: str | None = None,
        local_files_only: bool = False,
        optimizer: str = "torch.optim.AdamW",
        optimizer_kwargs: dict[str, Any] | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        scheduler: Literal["cosine", "constant"] = "cosine",
        warmup_steps: int = 0,
        warmup_ratio: float = 0.0,
        min_lr_ratio: float = 0.0,
        max_new_tokens: int = 64,
        max_generate_samples: int | None = 128,
        generate_batch_size: int | None = None,
        lora: LoraOptions | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_source(pretrained, model_config)  # the model itself is built in configure_model
        # LightningCLI and load_from_checkpoint hand the block over as a dict
        self._lora = LoraOptions(**lora) if isinstance(lora, dict) else lora
        if self._lora is not None:
            check_lora(self._lora)
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._prompts = EvalPrompts()

    # -- tokenizer: the datamodule's when there is one, so data and generation agree --------------------------------
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
            tok = getattr(dm, "tokenizer", None)
            if tok is None:
                tok = load_tokenizer(self.hparams.tokenizer or self._local_tokenizer_path())
            self._tokenizer = tok
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tok: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tok

    def _local_tokenizer_path(self) -> str | None:
        path = self.hparams.pretrained
        if path and os.path.isfile(os.path.join(os.path.expanduser(path), "tokenizer_config.json")):
            return path
        return None

    # -- the model: built in configure_model, so lazytrain loads it once per machine ---------------------------------
    @property
    def model(self) -> PreTrainedModel:
        """The HF model (``state_dict`` keys ``model.*``); used outside a Trainer, it is built on first use."""
        if "model" not in self._modules:
            self.configure_model()
        return self._modules["model"]

    def configure_model(self) -> None:
        """Build the model once. The Trainer calls this inside its strategy's context: with lazytrain and several
        processes that is the meta device on a machine's other ranks, which then map local rank 0's weights."""
        hp = self.hparams
        if "model" not in self._modules:
            # nn.Module.__setattr__ files a module under _modules, where the property above reads it
            source = (hp.pretrained, hp.model_config, hp.dtype, hp.trust_remote_code, hp.attn_implementation,
                      hp.revision, hp.cache_dir, hp.local_files_only)
            if self._lora is not None and self._lora.quantize != "none":  # QLoRA: layer by layer, never whole
                run_device = self._trainer.strategy.root_device if self._trainer is not None else None
                device = layer_build_device(self._lora, run_device)
                model = build_quantized_model(self._lora.quantize, *source, device=device)
            else:
                model = build_model(*source)
            self.model = add_adapters(model, self._lora) if self._lora is not None else model
        if self._trainer is not None:  # the tokenizer is the datamodule's only once a Trainer runs the module
            seq = getattr(getattr(self._trainer.datamodule, "hparams", None), "max_seq_length", None)
            if isinstance(seq, int):
                check_sequence_length(self.model.config, seq, sequence_source(hp.pretrained))
            vocab = self.model.get_input_embeddings().num_embeddings
            if len(self.tokenizer) > vocab:
                raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens but the model's embedding only {vocab};"
                                 " set model_config.vocab_size to at least the tokenizer length")

    # -- training -----------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.model(**model_inputs(batch)).loss
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    # -- evaluation ---------------------------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._prompts.clear()

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        self._generate_gathered("val")

    def on_test_epoch_end(self) -> None:
        self._generate_gathered("test")

    def _eval_step(self, batch: dict[str, Any], prefix: str) -> None:
        n = batch["input_ids"].shape[0]
        out = self.model(**model_inputs(batch))
        self.log(f"{prefix}/loss", out.loss, prog_bar=True, batch_size=n)
        logits = getattr(out, "logits", None)
        streamed_acc = getattr(out, "token_accuracy", None)
        if streamed_acc is not None:  # lazytrain fuses the head into the loss and reports the accuracy itself
            keep = batch["labels"][:, 1:] != IGNORE_INDEX
            self.log(f"{prefix}/token_acc", streamed_acc, batch_size=int(keep.sum()))
        elif logits is not None:
            # teacher-forced accuracy on response tokens: position t predicts token t+1
            pred, gold = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
            keep = gold != IGNORE_INDEX
            if keep.any():
                acc = (pred[keep] == gold[keep]).float().mean()
                self.log(f"{prefix}/token_acc", acc, batch_size=int(keep.sum()))
        cap = self.hparams.max_generate_samples
        room = n if cap is None else min(n, cap - len(self._prompts))
        if room > 0 and "gen_input_ids" in batch:
            gen_ids, gen_mask = batch["gen_input_ids"][:room], batch["gen_attention_mask"][:room]
            self._prompts.add(gen_ids, gen_mask, batch["answers"][:room])

    def _generate_gathered(self, prefix: str) -> None:
        """Greedy answers for every prompt of the evaluation; exact match, decode tokens/s and wall seconds."""
        prompts, n = self._prompts, len(self._prompts)
        if n == 0:
            return
        step = self.hparams.generate_batch_size or n
        hits, tokens, start = 0, 0, time.perf_counter()
        for first in range(0, n, step):
            ids, mask = prompts.batch(first, min(n, first + step), self._pad_id())
            new_ids = self._generate_new_ids(ids, mask)
            tokens += new_token_count(new_ids, end_of_turn_id(self.tokenizer))
            texts = self.tokenizer.batch_decode(new_ids, skip_special_tokens=True)
            refs = prompts.answers[first : first + step]
            hits += sum(answers_match(t, ref) for t, ref in zip(texts, refs, strict=True))
        seconds = time.perf_counter() - start
        prompts.clear()
        self.log(f"{prefix}/exact_match", hits / n, prog_bar=True, batch_size=n)
        self.log(f"{prefix}/generate_s", seconds, batch_size=n)
        self.log(f"{prefix}/generate_tokens_per_s", tokens / max(seconds, 1e-9), batch_size=n)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[dict[str, Any]]:
        texts = self.generate_answers(batch["gen_input_ids"], batch["gen_attention_mask"])
        return [{"generated": t, "reference": r, "match": answers_match(t, r)}
                for t, r in zip(texts, batch["answers"], strict=True)]

    def _pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else end_of_turn_id(tok)

    @torch.no_grad()
    def _generate_new_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=self.hparams.max_new_tokens,
            do_sample=False, eos_token_id=end_of_turn_id(self.tokenizer), pad_token_id=self._pad_id(), use_cache=True,
        )
        return out[:, input_ids.shape[1]:]

    def generate_answers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[str]:
        """Greedy, batched, left-padded generation of at most ``max_new_tokens``; returns the decoded new text."""
        return self.tokenizer.batch_decode(self._generate_new_ids(input_ids, attention_mask), skip_special_tokens=True)

    # -- optimizer ----------------------------------------------------------------------------------------------------
    def _param_groups(self) -> list[dict[str, Any]]:
        # the usual AdamW convention: no weight decay on biases and norm scales (1-D tensors)
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return groups

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        cls = _import_class(hp.optimizer)
        opt = cls(self._param_groups(), lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, weight_decay=hp.weight_decay,
                  **(hp.optimizer_kwargs or {}))
        total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
        total = total if 0 < total < 2**62 else 1  # max_steps=-1 with no epoch limit reports inf
        warmup = hp.warmup_steps or int(hp.warmup_ratio * total)
        floor = 1.0 if hp.scheduler == "constant" else hp.min_lr_ratio
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, warmup, total, floor))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "name": "lr"}}
