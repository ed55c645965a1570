"""Export the trained model as a Hugging Face directory (safetensors + config + tokenizer), atomically.

The directory is written under a temporary name beside the target and renamed at the end, so a crash or a full
disk never leaves a half-written export where `from_pretrained` would find it. The weights are written in bf16 by
default (what serving loads; half the bytes of the fp32 masters), or in the dtype asked for; the cast copy costs
that many bytes per parameter of host memory while the export runs.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: the dtype of exported weights unless another is asked for
EXPORT_DTYPE = torch.bfloat16


def export_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a floating torch dtype (``"bfloat16"``, ``"float32"``, ...); None keeps the model's own."""
    if dtype is None or isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if resolved is not None and (not isinstance(resolved, torch.dtype) or not resolved.is_floating_point):
        raise ValueError(f"export dtype {dtype!r} is not a floating torch dtype: use bfloat16, float16 or float32")
    return resolved


def _cast_state_dict(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's state dict with floating tensors in ``dtype``; tied tensors stay one tensor (one cast each)."""
    cast: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            key = id(tensor) if tensor.device.type == "meta" else tensor.data_ptr()
            out[name] = cast.setdefault(key, tensor.detach().to(dtype))
        else:
            out[name] = tensor
    return out


def export_hf(
    model: PreTrainedModel,
    out_dir: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase | None = None,
    overwrite: bool = True,
    max_shard_size: str = "5GB",
    dtype: torch.dtype | str | None = EXPORT_DTYPE,
) -> Path:
    """Save ``model`` (and ``tokenizer``) so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it.

    Floating weights are written in ``dtype`` (bf16 by default; None: as the model holds them) and ``config.json``
    records that dtype, so ``from_pretrained(out_dir, dtype="auto")`` loads them as written.
    """
    want = export_dtype(dtype)
    target = Path(out_dir).expanduser().resolve()
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        if want is None or all(t.dtype == want for t in model.state_dict().values() if t.is_floating_point()):
            model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        else:
            state = _cast_state_dict(model, want)
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True, max_shard_size=max_shard_size)
            del state
            config = copy.deepcopy(model.config)  # save_pretrained wrote the parameters' dtype
            config.dtype = str(want).removeprefix("torch.")
            config.save_pretrained(tmp)
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
