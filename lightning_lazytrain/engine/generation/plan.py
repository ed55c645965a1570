"""Admission for evaluation-time generation: resident weights, or the streamed stack serving a whole batch.

Pure byte accounting from the model config, no torch. Streaming a 7B model moves ~15 GB per decode step, so when
the layers fit on the device beside the KV cache and the generation's activations they are loaded once per
evaluation ("resident"); otherwise every prompt of the evaluation is decoded together ("streamed"), each pass over
the layers serving as many prompts as the memory allows, with the KV cache on the device or in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightning_lazytrain.units import GIB

GenerationMode = Literal["auto", "resident", "streamed"]
GENERATION_MODES = ("auto", "resident", "streamed")


def check_generation_mode(mode: str) -> GenerationMode:
    """``mode`` if it is a ``generation`` value, else a ValueError naming the ones there are."""
    if mode not in GENERATION_MODES:
        raise ValueError(f"generation must be one of {GENERATION_MODES}, got {mode!r}")
    return mode  # type: ignore[return-value]

#: share of the free device memory a generation plan may take: the caching allocator rounds and fragments
DEVICE_USABLE_SHARE = 0.9


@dataclass(frozen=True)
class GenerationCosts:
    """Bytes one sequence costs while it is generated."""

    kv_bytes_per_token: int  # keys and values of every full-attention layer
    state_bytes_per_sequence: int  # fixed-size recurrent and convolution states (linear-attention layers)
    activation_bytes_per_token: int  # the prefill's largest working set, per prompt token
    logits_bytes_per_sequence: int  # next-token logits and the processors' copies
    cache_layers: int


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, None)
    return default if value is None else value


def generation_costs(config: Any, itemsize: int) -> GenerationCosts:
    """Per-sequence generation bytes of an HF decoder config at ``itemsize`` bytes per element (compute dtype)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = _get(config, "num_key_value_heads", heads)
    head_dim = _get(config, "head_dim", hidden // heads)
    types = list(_get(config, "layer_types", ["full_attention"] * layers))
    linear = sum(1 for t in types if t == "linear_attention")
    full = layers - linear
    state = 0
    if linear:
        k_dim, v_dim = _get(config, "linear_key_head_dim", 128), _get(config, "linear_value_head_dim", 128)
        k_heads, v_heads = _get(config, "linear_num_key_heads", 16), _get(config, "linear_num_value_heads", 32)
        conv = (2 * k_heads * k_dim + v_heads * v_dim) * _get(config, "linear_conv_kernel_dim", 4) * itemsize
        recurrent = v_heads * k_dim * v_dim * 4  # the recurrent state is kept in fp32
        state = linear * (conv + recurrent)
    # q, k, v, attention output, residual and norm (~4 hidden), gate, up and their product (~3 intermediate)
    intermediate = _get(config, "intermediate_size", 4 * hidden)
    activation = (4 * hidden + 3 * intermediate) * itemsize
    return GenerationCosts(
        kv_bytes_per_token=full * 2 * kv_heads * head_dim * itemsize,
        state_bytes_per_sequence=state,
        activation_bytes_per_token=activation,
        logits_bytes_per_sequence=3 * config.vocab_size * 4,
        cache_layers=max(1, layers),
    )


@dataclass(frozen=True)
class GenerationPlan:
    """How one ``generate`` call runs, with the bytes that decided it."""

    mode: Literal["resident", "streamed"]
    prompts: int
    batch_size: int  # prompts decoded together: each pass over the layers serves this many
    kv_on_device: bool
    weights_bytes: int  # the decoder layers in the compute dtype (loaded once in resident mode)
    kv_bytes: int  # the KV cache and states of one batch
    activation_bytes: int  # prefill working set and logits of one batch
    device_free_bytes: int
    forced: bool = False

    @property
    def batches(self) -> int:
        return -(-self.prompts // self.batch_size)

    def describe(self) -> str:
        kv_home = "device" if self.kv_on_device else "host"
        how = "forced" if self.forced else "chosen"
        weights = f"layer weights {_size(self.weights_bytes)}"
        if self.mode == "resident":
            head = f"resident ({how}): {weights} loaded once per evaluation"
            need = self.weights_bytes + self.kv_bytes + self.activation_bytes
        else:
            head = f"streamed, batched ({how}): {weights} stream once per decode step"
            need = self.kv_bytes + self.activation_bytes if self.kv_on_device else self.activation_bytes
        return (
            f"{head} + KV cache {_size(self.kv_bytes)} on the {kv_home} + activations"
            f" {_size(self.activation_bytes)} = {_size(need)} on the device of"
            f" {self.device_free_bytes / GIB:.2f} GiB free; {self.prompts} prompts in {self.batches} batch(es)"
            f" of up to {self.batch_size}"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


def _kv(costs: GenerationCosts, batch: int, total_tokens: int) -> int:
    return batch * (total_tokens * costs.kv_bytes_per_token + costs.state_bytes_per_sequence)


def _activations(costs: GenerationCosts, batch: int, prompt_tokens: int) -> int:
    return batch * (prompt_tokens * costs.activation_bytes_per_token + costs.logits_bytes_per_sequence)


def _largest_batch(prompts: int, fits) -> int:
    """The largest batch in [1, prompts] for which ``fits(batch)`` holds (monotone), 0 when none does."""
    lo, hi = 0, prompts
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def plan_generation(
    costs: GenerationCosts,
    prompts: int,
    prompt_tokens: int,
    new_tokens: int,
    weights_bytes: int,
    device_free_bytes: int,
    host_free_bytes: int | None,
    mode: GenerationMode = "auto",
) -> GenerationPlan:
    """Resident when the layer weights fit beside one prompt's cache and activations (a larger batch when more
    fits); otherwise streamed with the largest batch whose cache fits on the device, or in host memory (one
    layer's share on the device at a time) when that serves more prompts per pass. ``host_free_bytes=None``: the
    device is the host (CPU), so the cache has no second home."""
    if mode not in GENERATION_MODES:
        raise ValueError(f"generation mode must be one of {GENERATION_MODES}, got {mode!r}")
    if prompts < 1:
        raise ValueError(f"a generation plan needs at least one prompt, got {prompts}")
    budget = int(device_free_bytes * DEVICE_USABLE_SHARE)
    total = prompt_tokens + new_tokens

    def on_device(b: int) -> int:
        return _kv(costs, b, total) + _activations(costs, b, prompt_tokens)

    def plan(kind, batch: int, kv_on_device: bool = True) -> GenerationPlan:
        return GenerationPlan(
            kind,
            prompts,
            batch,
            kv_on_device,
            weights_bytes,
            _kv(costs, batch, total),
            _activations(costs, batch, prompt_tokens),
            device_free_bytes,
            forced=mode != "auto",
        )

    resident_batch = _largest_batch(prompts, lambda b: weights_bytes + on_device(b) <= budget)
    if mode == "resident" or (mode == "auto" and resident_batch > 0):
        if resident_batch == 0:
            raise ValueError(
                f"generation='resident' needs the layer weights ({weights_bytes / GIB:.2f} GiB) plus one prompt's"
                f" cache and activations ({on_device(1) / GIB:.2f} GiB) on the device, which has"
                f" {device_free_bytes / GIB:.2f} GiB free; use generation='streamed' or 'auto'."
            )
        return plan("resident", resident_batch)
    device_batch = _largest_batch(prompts, lambda b: on_device(b) <= budget)
    host_batch = 0
    if host_free_bytes is not None:
        per_layer = max(1, costs.cache_layers)

        def on_host(b: int) -> bool:
            kv = _kv(costs, b, total)
            # the offloaded cache keeps the running layer and the prefetched next one on the device
            return kv <= host_free_bytes and 2 * kv // per_layer + _activations(costs, b, prompt_tokens) <= budget

        host_batch = _largest_batch(prompts, on_host)
    if max(device_batch, host_batch) == 0:
        raise ValueError(
            f"one prompt of {prompt_tokens} tokens generating {new_tokens} needs {on_device(1) / GIB:.2f} GiB on the"
            f" device, which has {device_free_bytes / GIB:.2f} GiB free: shorten max_new_tokens or the prompts."
        )
    if host_batch > device_batch:
        return plan("streamed", host_batch, kv_on_device=False)
    return plan("streamed", device_batch)
