"""The recipe's model on the meta device, for ``lazytrain plan``: its config only, no weights.

``model.model_config`` (a name from `NAMED_SHAPES`, a dict, a config path) is used as given. ``model.pretrained``
is looked up as a local directory, then in the hub cache, then on the hub (config.json only, unless
``HF_HUB_OFFLINE`` is set, or the hub's host cannot be reached: a machine without a network falls back at once
instead of waiting out the hub client's retries, about 25 s); a recipe model the hub cannot be asked about falls
back to its published shape (`NAMED_SHAPES`), and the plan says so.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lightning_lazytrain.sft.module import NAMED_SHAPES


def _named(name: str) -> PretrainedConfig:
    fields = dict(NAMED_SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_unreachable() -> str | None:
    """Why the hub cannot be asked (no connection to its host within a few seconds), or None. Behind a proxy a
    direct connection says nothing of the hub, so none is tried."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname, port), timeout=3).close()
    except OSError as exc:
        return f"{url.hostname}:{port} cannot be reached ({exc})"
    return None


def _pretrained_config(name: str, trust_remote_code: bool) -> tuple[PretrainedConfig, str]:
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True), path
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, local_files_only=True)
        return config, f"{name} (hub cache)"
    except OSError:
        pass
    error = "HF_HUB_OFFLINE is set" if _offline() else _hub_unreachable()
    if error is None:
        try:
            return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code), f"{name} (hub)"
        except OSError as exc:
            error = str(exc)
    shape = name.rsplit("/", 1)[-1].lower()
    if shape in NAMED_SHAPES:
        return _named(shape), f"published shape {shape!r} (no config.json for {name} in the cache or on the hub)"
    raise ValueError(
        f"model.pretrained={name!r}: no config.json in a local directory, the hub cache or the hub ({error})"
        f"; give a local directory, or --model.model_config with one of "
        f"{', '.join(NAMED_SHAPES)}"
    )


def model_config(
    pretrained: str | None, model_config: dict[str, Any] | str | None, trust_remote_code: bool = False
) -> tuple[PretrainedConfig, str]:
    """(config, where it came from) for the recipe's model section."""
    if (pretrained is None) == (model_config is None):
        raise ValueError("give exactly one of model.pretrained (weights) or model.model_config (random init)")
    if pretrained is not None:
        return _pretrained_config(pretrained, trust_remote_code)
    if isinstance(model_config, str) and model_config.lower() in NAMED_SHAPES:
        return _named(model_config.lower()), f"model_config {model_config!r}"
    if isinstance(model_config, dict):
        fields = dict(model_config)
        if "model_type" not in fields:
            raise ValueError(f"model.model_config needs a 'model_type' (e.g. 'qwen2'); got keys {sorted(fields)}")
        return AutoConfig.for_model(fields.pop("model_type"), **fields), "model_config (inline)"
    path = os.path.expanduser(str(model_config))
    local = os.path.exists(path)
    config = AutoConfig.from_pretrained(
        path if local else str(model_config), trust_remote_code=trust_remote_code, local_files_only=local or _offline()
    )
    return config, str(model_config)


def meta_model(config: PretrainedConfig, trust_remote_code: bool = False) -> PreTrainedModel:
    """The causal LM of ``config`` with every tensor on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, trust_remote_code=trust_remote_code)
