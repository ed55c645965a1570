"""Building the recipe's HF causal LM: from weights (a hub name or a local directory) or, for random-init runs, from
a config (a dict, a name in `NAMED_SHAPES`, a config path).

Hub options are passed through to ``from_pretrained``: ``revision`` (a branch, tag or commit), ``cache_dir`` (the
hub cache to read and fill), ``local_files_only`` (never reach the network: the cache or the directory only) and
``trust_remote_code`` (off unless asked: it runs Python that the model repository ships). A local directory is
always read with ``local_files_only`` so nothing is fetched for it.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lightning_lazytrain.models.layerwise import build_quantized
from lightning_lazytrain.models.quantize import QuantType
from lightning_lazytrain.node_load import load_pretrained
from lightning_lazytrain.sft.data.errors import DataSettingError

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]

# Published shapes of the recipe models, for random-init runs where no weights can be downloaded (the H200 image):
# `model_config: qwen2.5-3b` builds the real architecture with random weights.
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-3b": dict(
        model_type="qwen2",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        rope_theta=1e6,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    "qwen2.5-14b": dict(
        model_type="qwen2",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
        rope_theta=1e6,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
    ),
    "qwen2.5-72b": dict(
        model_type="qwen2",
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
        rope_theta=1e6,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        rope_theta=1e6,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
    ),
    # REFERENCE.md's 27B text shape; the linear-attention widths are transformers' Qwen3.5 defaults (25.4 B params
    # with them vs the paper's 23.68 B: check against the checkpoint's config.json before comparing numbers)
    "qwen3.6-27b": dict(
        model_type="qwen3_5_text",
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=248320,
    ),
}


def _torch_dtype(name: str | None) -> torch.dtype | str | None:
    if name is None or name == "auto":
        return name
    return getattr(torch, name)


def _source(name: str, revision: str | None, cache_dir: str | None, local_files_only: bool) -> tuple[str, dict]:
    """(path or hub name, the hub keyword arguments for it): a local path is read as it is, offline."""
    expanded = os.path.expanduser(name)
    if os.path.exists(expanded):
        return expanded, {"local_files_only": True}
    hub: dict[str, Any] = {"local_files_only": local_files_only}
    if revision is not None:
        hub["revision"] = revision
    if cache_dir is not None:
        hub["cache_dir"] = os.path.expanduser(cache_dir)
    return name, hub


def _where(hub: dict[str, Any]) -> str:
    if "revision" not in hub and "cache_dir" not in hub and not hub.get("local_files_only"):
        return ""
    words = [f"revision {hub.get('revision', 'main')}", f"hub cache {hub.get('cache_dir', 'the default (HF_HOME)')}"]
    if hub.get("local_files_only"):
        words.append("local files only")
    return " (" + ", ".join(words) + ")"


def position_limit(config: PretrainedConfig) -> int | None:
    """The longest sequence the model's positions cover: ``max_position_embeddings``, raised by a RoPE scaling
    ``factor`` (over ``original_max_position_embeddings`` where given: YaRN, Llama 3); None when not stated."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if isinstance(factor, (int, float)) and factor > 1:
        original = rope.get("original_max_position_embeddings") or limit
        limit = max(limit, int(original * factor))
    return limit


def check_sequence_length(config: PretrainedConfig, max_seq_length: int, source: str) -> None:
    """Refuse a ``max_seq_length`` past the model's positions (`position_limit`): a RoPE model runs them untrained
    for those positions and one of learned positions fails. ``source`` names the model in the message."""
    limit = position_limit(config)
    if limit is not None and max_seq_length > limit:
        raise DataSettingError(
            "data.max_seq_length",
            f"{max_seq_length} is longer than the {limit} positions of the model ({source}: max_position_embeddings"
            f"={config.max_position_embeddings})",
            f"Lower data.max_seq_length to {limit} or less, or give the model more positions (for a random-init"
            " model: model.model_config.max_position_embeddings)",
        )


def sequence_source(pretrained: str | None) -> str:
    """How `check_sequence_length`'s message names the model of a module's or a config's model section."""
    return f"model.pretrained {pretrained}" if pretrained else "model.model_config"


def check_positions_before_build(model: Any, max_seq_length: int) -> None:
    """`check_sequence_length` on the config of a model section (``model.*`` of a run's config) alone, read from
    the local directory or the hub cache (no weights, no network), so that a run is refused before its data is
    tokenized and its model loaded. A config not read here (not cached, or an invalid section) is left to the
    model's build, which reports it and checks the positions itself."""
    pretrained, model_config = model.get("pretrained"), model.get("model_config")
    if (pretrained is None) == (model_config is None):
        return
    trust_remote_code = bool(model.get("trust_remote_code"))
    try:
        if pretrained is not None:
            path, hub = _source(pretrained, model.get("revision"), model.get("cache_dir"), True)
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **hub)
        else:
            config = _random_init_config(
                model_config, trust_remote_code, model.get("revision"), model.get("cache_dir"), True
            )
    except (OSError, ValueError, TypeError, KeyError):
        return
    check_sequence_length(config, max_seq_length, sequence_source(pretrained))


def check_source(pretrained: str | None, model_config: dict[str, Any] | str | None) -> None:
    """Refuse a module without exactly one model source when it is made, not only when the model is built."""
    if (pretrained is None) == (model_config is None):
        raise ValueError("give exactly one of `pretrained` (weights) or `model_config` (random init)")


def _random_init_config(model_config: dict[str, Any] | str, trust_remote_code: bool, revision: str | None,
                        cache_dir: str | None, local_files_only: bool) -> PretrainedConfig:
    if isinstance(model_config, str) and model_config.lower() in NAMED_SHAPES:
        model_config = dict(NAMED_SHAPES[model_config.lower()])
    if isinstance(model_config, dict):
        fields = dict(model_config)
        if "model_type" not in fields:
            raise ValueError(f"model_config needs a 'model_type' (e.g. 'qwen2'); got keys {sorted(fields)}")
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    path, hub = _source(model_config, revision, cache_dir, local_files_only)
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **hub)


def build_quantized_model(
    quantize: QuantType,
    pretrained: str | None = None,
    model_config: dict[str, Any] | str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    revision: str | None = None,
    cache_dir: str | None = None,
    local_files_only: bool = False,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """:func:`build_model`'s model with its decoder layers' linear layers 4-bit (QLoRA), built layer by layer from
    the safetensors shards (a local directory, or the hub snapshot of ``pretrained``) or random init
    (``models/layerwise.py``): the whole full-precision base is never held. Computes in ``dtype`` (``auto``/None:
    the checkpoint's, else float32). ``device``: where each layer is materialised (shards read on the CPU, copied
    there) and quantized; the model is held on the host either way."""
    check_source(pretrained, model_config)
    if pretrained is not None:
        path, hub = _source(pretrained, revision, cache_dir, local_files_only)
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **hub)
            weights = path if os.path.isdir(path) else _snapshot(path, hub)
        except OSError as exc:
            raise OSError(f"model.pretrained {pretrained!r}{_where(hub)} cannot be loaded: {exc}") from exc
    else:
        config = _random_init_config(model_config, trust_remote_code, revision, cache_dir, local_files_only)
        weights = None
    target = _torch_dtype(dtype)
    if not isinstance(target, torch.dtype):
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        target = _torch_dtype(saved) if isinstance(saved, str) else saved
    if not isinstance(target, torch.dtype):
        target = torch.float32
    return build_quantized(config, quantize, target, weights, trust_remote_code, attn_implementation, device=device)


def _snapshot(name: str, hub: dict[str, Any]) -> str:
    """The local directory of the hub model ``name``'s config and safetensors shards (downloaded if missing)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(name, allow_patterns=["*.json", "*.safetensors"], revision=hub.get("revision"),
                             cache_dir=hub.get("cache_dir"), local_files_only=hub.get("local_files_only", False))


def build_model(
    pretrained: str | None = None,
    model_config: dict[str, Any] | str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    revision: str | None = None,
    cache_dir: str | None = None,
    local_files_only: bool = False,
) -> PreTrainedModel:
    """An HF causal LM in training mode, from weights (hub name or local dir) or, for random-init runs, a config.

    ``model_config`` is a dict with ``model_type`` and config fields, a name in :data:`NAMED_SHAPES`, or a config
    path/hub name. ``revision``, ``cache_dir`` and ``local_files_only`` apply to hub names (the module docstring).
    """
    check_source(pretrained, model_config)
    attn = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if pretrained is not None:
        path, hub = _source(pretrained, revision, cache_dir, local_files_only)
        try:
            # on a machine's other ranks under lazytrain this reads the config only (node_load.py)
            # from_pretrained looks for a PEFT adapter config without the cache and offline settings it was given
            # (transformers 5): without them it asks the hub, and offline waits out its retries (~45 s)
            adapter = {k: hub[k] for k in ("cache_dir", "local_files_only") if k in hub}
            model = load_pretrained(
                path,
                dtype=_torch_dtype(dtype) or "auto",
                trust_remote_code=trust_remote_code,
                adapter_kwargs=adapter,
                **hub,
                **attn,
            )
        except OSError as exc:
            raise OSError(f"model.pretrained {pretrained!r}{_where(hub)} cannot be loaded: {exc}") from exc
        # from_pretrained returns the model in eval mode and Lightning keeps the mode it finds at fit start: left
        # so, dropout would be off in training (and the meta-built copies of other ranks, made by from_config, on)
        return model.train()
    config = _random_init_config(model_config, trust_remote_code, revision, cache_dir, local_files_only)
    target = _torch_dtype(dtype)
    # build directly in the target dtype: a 14B model built in fp32 and then cast would need 1.5x its bytes at once
    kwargs = {"dtype": target} if isinstance(target, torch.dtype) else {}
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **attn, **kwargs)
    if isinstance(target, torch.dtype) and model.dtype != target:
        model = model.to(target)
    return model
