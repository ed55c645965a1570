"""Export the trained model as a Hugging Face directory (safetensors + config + tokenizer), atomically.

The directory is written under a temporary name beside the target and renamed at the end, so a crash or a full
disk never leaves a half-written export where `from_pretrained` would find it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

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
