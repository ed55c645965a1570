"""Directory checkpoints of a multi-process run, and their consolidation into one HF model directory.

``<ckpt>/rank_<r>.pt`` holds what Lightning gives every rank to save (loops, callbacks, LR schedulers...) with
``state_dict`` = that rank's master shards (one flat tensor per unit) and ``optimizer_states`` = the state of
its shard optimizer; ``<ckpt>/meta.pt`` (rank 0) holds the world size and the layout: for every unit its size,
padded size and which parameter names sit at which offsets. Resuming needs the same world size (each rank reads
its own file, nothing is re-sharded); ``consolidate`` and ``export_sharded_hf`` need no processes at all.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_lazytrain.checkpoint.hf_export import EXPORT_DTYPE, export_hf
from lightning_lazytrain.engine.weights.shared_store import SharedParamStore

FORMAT = "lazytrain-sharded-1"
META = "meta.pt"


def is_sharded(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(os.path.join(path, META))


def layout_meta(store: SharedParamStore, model: PreTrainedModel) -> dict[str, Any]:
    """Where every parameter of ``model`` sits in the flat units (names as in ``model.state_dict()``)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    units = [{"label": u.label, "numel": lay.numel, "padded": lay.padded,
              "params": [(names[id(e.param)], e.offset, e.numel, tuple(e.shape)) for e in u.unique]}
             for u, lay in zip(store.units, store.layouts)]
    return {"format": FORMAT, "world_size": store.topology.world_size, "units": units}


def save_sharded(checkpoint: dict[str, Any], path: str | os.PathLike[str], rank: int,
                 meta: dict[str, Any] | None) -> None:
    """Write this rank's file (and, with ``meta``, the layout), each under a temporary name renamed at the end."""
    os.makedirs(path, exist_ok=True)
    files = [(f"rank_{rank}.pt", checkpoint)] + ([(META, meta)] if meta is not None else [])
    for name, obj in files:
        target = os.path.join(path, name)
        torch.save(obj, target + ".tmp")
        os.replace(target + ".tmp", target)


def load_sharded(path: str | os.PathLike[str], rank: int, world_size: int) -> dict[str, Any]:
    meta = torch.load(os.path.join(path, META), weights_only=False)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a lazytrain sharded checkpoint (format {meta.get('format')!r})")
    if meta["world_size"] != world_size:
        raise ValueError(f"{path} was saved by {meta['world_size']} processes; resume it with the same number of"
                         f" processes (devices x num_nodes), not {world_size}, or export it with export_sharded_hf")
    return torch.load(os.path.join(path, f"rank_{rank}.pt"), weights_only=False)


def remove_sharded(path: str | os.PathLike[str]) -> None:
    shutil.rmtree(path, ignore_errors=True)


def consolidate(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The full master weights of a sharded checkpoint as a state dict of the HF model, read one unit at a time."""
    meta = torch.load(os.path.join(path, META), weights_only=False)
    shards = [torch.load(os.path.join(path, f"rank_{r}.pt"), weights_only=False, mmap=True)["state_dict"]
              for r in range(meta["world_size"])]
    out: dict[str, torch.Tensor] = {}
    for unit in meta["units"]:
        flat = torch.cat([s[unit["label"]] for s in shards])[: unit["numel"]]
        for names, offset, numel, shape in unit["params"]:
            tensor = flat[offset : offset + numel].view(shape).clone()
            for name in names:
                out[name] = tensor
    return out


def export_sharded_hf(path: str | os.PathLike[str], model: PreTrainedModel, out_dir: str | os.PathLike[str],
                      tokenizer: PreTrainedTokenizerBase | None = None,
                      dtype: torch.dtype | str | None = EXPORT_DTYPE) -> Path:
    """Load a sharded checkpoint's weights into ``model`` (same architecture) and export it as an HF directory
    (weights in ``dtype``: bf16 by default, None as the checkpoint holds them)."""
    state = consolidate(path)
    missing = set(model.state_dict()) - set(state)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if missing & params:
        raise KeyError(f"the checkpoint lacks parameters of this model: {sorted(missing & params)[:5]}")
    model.load_state_dict(state, strict=False)
    return export_hf(model, out_dir, tokenizer=tokenizer, dtype=dtype)
