"""Export the trained model as a Hugging Face directory (safetensors + config + tokenizer), atomically.

The directory is written under a temporary name beside the target and renamed at the end, so a crash or a full
disk never leaves a half-written export where `from_pretrained` would find it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import lightning.pytorch as pl
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def export_hf(
    model: PreTrainedModel,
    out_dir: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase | None = None,
    overwrite: bool = True,
    max_shard_size: str = "5GB",
) -> Path:
    """Save ``model`` (and ``tokenizer``) so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it."""
    target = Path(out_dir).expanduser().resolve()
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if target.exists():
            # move the old export aside first, so at every moment one complete export sits at `target` or beside it
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


class HFExportCallback(pl.Callback):
    """Export ``pl_module.model`` (and the module's or datamodule's tokenizer) as an HF directory when fit ends."""

    def __init__(self, dirpath: str, max_shard_size: str = "5GB") -> None:
        self.dirpath, self.max_shard_size = dirpath, max_shard_size

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        model = getattr(pl_module, "model", None)
        if not isinstance(model, PreTrainedModel):
            raise TypeError("HFExportCallback needs the LightningModule's `model` to be a transformers PreTrainedModel")
        tok = getattr(pl_module, "tokenizer", None) or getattr(trainer.datamodule, "tokenizer", None)
        export_hf(model, self.dirpath, tokenizer=tok, max_shard_size=self.max_shard_size)
