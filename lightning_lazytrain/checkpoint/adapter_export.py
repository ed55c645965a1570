"""Export of a trained model that may be peft-wrapped: LoRA adapters in peft's own format, the merged model on
request, a plain HF model as ``export_hf`` writes it.

``PeftModel.from_pretrained(base, out_dir)`` loads the adapter directory over the same base; the merged directory
(``merged_dir``) loads alone with ``AutoModelForCausalLM.from_pretrained``. Merging works on a copy, so the
trained module keeps its adapters (the copy costs one more base in host RAM while it is written). Over a 4-bit
(QLoRA) base the merged model is full precision: each adapted weight is bitsandbytes' dequantized base plus the
adapter's delta, not re-quantized (peft's own merge would quantize the sum again, and transformers could not load
the 4-bit layers without a quantization config).
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_lazytrain.checkpoint.hf_export import EXPORT_DTYPE, export_hf
from lightning_lazytrain.models.quantize import dequantized_weight, full_precision_linear, is_4bit_linear


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
        merged = _merged(model)
        export_hf(merged, merged_dir, tokenizer=tokenizer, max_shard_size=max_shard_size, dtype=dtype)
    return target


def _merged(model: nn.Module) -> PreTrainedModel:
    """A copy of the peft ``model`` with its adapters merged in, its 4-bit layers as full-precision ones."""
    from peft.tuners.lora import LoraLayer

    work = copy.deepcopy(model)
    weights: dict[int, torch.Tensor] = {}
    for module in work.modules():
        if isinstance(module, LoraLayer) and is_4bit_linear(module.get_base_layer()):
            base = module.get_base_layer()
            weight = dequantized_weight(base).float()
            for name in module.active_adapters:
                if name in module.lora_A:
                    weight = weight + module.get_delta_weight(name).float()
            weights[id(base)] = weight
    with warnings.catch_warnings():  # peft's re-quantized 4-bit merge is replaced below, its rounding with it
        warnings.filterwarnings("ignore", message="Merge lora module to 4-bit linear")
        merged = work.merge_and_unload()
    dtype = merged.dtype
    for parent in list(merged.modules()):
        for name, child in list(parent.named_children()):
            if is_4bit_linear(child):
                weight = weights.get(id(child))
                weight = dequantized_weight(child) if weight is None else weight
                setattr(parent, name, full_precision_linear(child, weight, dtype))
    merged.is_loaded_in_4bit = False
    return merged
