"""Export of a trained model that may be peft-wrapped: LoRA adapters in peft's own format, the merged model on
request, a plain HF model as ``export_hf`` writes it.

``PeftModel.from_pretrained(base, out_dir)`` loads the adapter directory over the same base; the merged directory
(``merged_dir``) loads alone with ``AutoModelForCausalLM.from_pretrained``. Merging works on a copy, so the
trained module keeps its adapters (the copy costs one more base in host RAM while it is written).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_lazytrain.checkpoint.hf_export import EXPORT_DTYPE, export_hf


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def check_exportable(model: object) -> None:
    """Raise ``TypeError`` for a model neither a transformers ``PreTrainedModel`` nor a peft model (at setup)."""
    if not isinstance(model, PreTrainedModel) and not (isinstance(model, nn.Module) and is_peft_model(model)):
        raise TypeError(f"the LightningModule's `model` is {type(model).__name__}: exporting needs a transformers"
                        " PreTrainedModel or a peft model wrapping one")


def export_model(model: nn.Module, out_dir: str | os.PathLike[str], tokenizer: PreTrainedTokenizerBase | None = None,
                 dtype: torch.dtype | str | None = EXPORT_DTYPE, merged_dir: str | os.PathLike[str] | None = None,
                 max_shard_size: str = "5GB") -> Path:
    """Write ``model`` to ``out_dir``: a peft model's adapters (and, with ``merged_dir``, the merged model there),
    or a plain model as :func:`export_hf` does."""
    check_exportable(model)
    if not is_peft_model(model):
        if merged_dir is not None:
            raise ValueError("merged_dir is for a peft model's merged weights; this model has no adapters to merge")
        return export_hf(model, out_dir, tokenizer=tokenizer, max_shard_size=max_shard_size, dtype=dtype)
    target = Path(out_dir).expanduser().resolve()
    model.save_pretrained(target, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)
    if merged_dir is not None:
        merged = copy.deepcopy(model).merge_and_unload()
        export_hf(merged, merged_dir, tokenizer=tokenizer, max_shard_size=max_shard_size, dtype=dtype)
    return target
