"""One load of the weights per machine: a machine's other local ranks build the model empty and map its copy.

In a multi-process run every rank would build the full model before the shared store takes its weights, so a
machine with N GPUs would hold N copies at once while loading. Instead the strategy runs ``configure_model`` (and
``Trainer.init_module``) on the host for local rank 0 and on the meta device for the machine's other ranks
(``init_context``): their parameters take no memory. At setup local rank 0 fills the machine's shared copy and
the others map it (``engine/weights/shared_store.py``); their buffers, which the meta device leaves without values
(rotary ``inv_freq``), are copied from local rank 0 first (``share_buffers``). A model built in ``__init__`` is
real on every rank and still works: each rank then loads its own copy, as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from lightning_lazytrain.engine.weights.shared_store import SharedParamStore
from lightning_lazytrain.engine.weights.store import HostParamStore
from lightning_lazytrain.engine.weights.topology import Topology

_HUB_KEYS = ("revision", "cache_dir", "local_files_only", "trust_remote_code", "token", "subfolder")


def building_empty() -> bool:
    """Whether tensors made now land on the meta device (a machine's other ranks inside ``init_context``)."""
    return torch.empty(0).device.type == "meta"


@contextmanager
def init_context(empty: bool) -> Iterator[None]:
    """Build on the host (never the GPU: the engine streams weights from host memory), or on the meta device."""
    with torch.device("meta" if empty else "cpu"):
        try:
            yield
        except RuntimeError as exc:
            if not (empty and "meta device context" in str(exc)):
                raise
            raise RuntimeError(
                "lazytrain builds configure_model on the meta device on a machine's other ranks (local rank 0 loads"
                " the weights once for the machine), and from_pretrained refuses that: call"
                " lightning_lazytrain.node_load.load_pretrained(name, ...) instead, which reads only the config"
                " there, or build the model in the LightningModule's __init__ (each rank then loads its own copy)"
            ) from exc


def load_pretrained(name: str, model_class: Any = AutoModelForCausalLM, **kwargs: Any) -> PreTrainedModel:
    """``model_class.from_pretrained(name, **kwargs)``; inside the empty context the same model on the meta device,
    from its config and generation config (no weights are read: local rank 0's shared copy fills it at setup)."""
    if not building_empty():
        return model_class.from_pretrained(name, **kwargs)
    hub = {k: kwargs[k] for k in _HUB_KEYS if k in kwargs}
    config = AutoConfig.from_pretrained(name, **hub)
    dtype = kwargs.get("dtype", "auto")
    if dtype == "auto" or dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    build = {k: kwargs[k] for k in ("attn_implementation", "trust_remote_code") if k in kwargs}
    model = model_class.from_config(config, dtype=dtype, **build)
    if model.can_generate():
        try:  # what generate() uses by default must match local rank 0's, which from_pretrained read
            model.generation_config = GenerationConfig.from_pretrained(name, **hub)
        except OSError:
            pass  # the repository ships none: from_pretrained keeps the config's defaults, as from_config did
    return model


def share_buffers(module: nn.Module, topo: Topology) -> None:
    """Every buffer of ``module`` takes local rank 0's values (a meta buffer gets storage first), so buffers that
    are not saved in checkpoints (rotary ``inv_freq``) are correct on ranks that built the model empty."""
    if topo.local_world == 1:
        return
    first = topo.node_rank * topo.local_world
    named = list(module.named_buffers(remove_duplicate=False))  # every slot of a shared buffer
    layout = [[(name, tuple(buf.shape), buf.dtype) for name, buf in named]]
    with topo.collective("the broadcast of the model's buffers from local rank 0"):
        dist.broadcast_object_list(layout, src=first, group=topo.local_group)
    if [name for name, _, _ in layout[0]] != [name for name, _ in named]:
        raise ValueError(f"local rank {topo.local_rank} built a model with other buffers than local rank 0: every"
                         " rank of a machine must build the same model")
    for (name, buf), (_, shape, dtype) in zip(named, layout[0]):
        owner, _, leaf = name.rpartition(".")
        target = buf if not buf.is_meta and buf.dtype == dtype else torch.empty(shape, dtype=dtype)
        with topo.collective(f"the broadcast of buffer {name} from local rank 0"):
            dist.broadcast(target, src=first, group=topo.local_group)
        module.get_submodule(owner)._buffers[leaf] = target


def check_built(module: nn.Module, topo: Topology) -> None:
    """After the store mapped the HF model, nothing of the LightningModule may be left on the meta device."""
    for name, tensor in [*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)]:
        if tensor.is_meta:
            raise ValueError(
                f"{name} of the LightningModule is on the meta device on local rank {topo.local_rank}: lazytrain"
                " builds configure_model on the meta device on a machine's other ranks and fills only the HF"
                f" model's weights from local rank 0's copy; create {name} in __init__ instead"
            )


def node_store(groups: list[tuple[str, list[nn.Module]]], master_dtype: torch.dtype, stream_dtype: torch.dtype,
               pin: bool, topology: Topology, module: nn.Module) -> HostParamStore:
    """The shared store of a multi-process run, with the buffers taken from local rank 0 before the engine copies
    them to the device."""
    share_buffers(module, topology)
    store = SharedParamStore(groups, master_dtype, stream_dtype, pin, topology=topology)
    check_built(module, topology)
    return store
