"""Generation admission: the bytes of the KV cache and the choice between resident and streamed decoding."""

import pytest
from helpers import tiny_config
from transformers import AutoConfig

from lightning_lazytrain.engine.generation.plan import generation_costs, plan_generation
from lightning_lazytrain.sft.module import NAMED_SHAPES

GIB = 1 << 30


def _config(name: str):
    fields = dict(NAMED_SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


QWEN7B = generation_costs(_config("qwen2.5-7b"), itemsize=2)
WEIGHTS_7B = 28 * 233_057_792 * 2  # 28 decoder layers of Qwen2.5-7B in bf16 (~12.2 GiB)


def test_kv_bytes_of_qwen2_5_7b_by_hand():
    # 28 layers x (K and V) x 4 KV heads x head_dim 128 x 2 bytes
    assert QWEN7B.kv_bytes_per_token == 28 * 2 * 4 * 128 * 2
    assert QWEN7B.state_bytes_per_sequence == 0


def test_hybrid_model_counts_full_attention_layers_and_linear_states():
    config = tiny_config("qwen3.5")  # 4 layers: three linear-attention, one full-attention (transformers' pattern)
    linear = config.layer_types.count("linear_attention")
    assert 0 < linear < config.num_hidden_layers
    costs = generation_costs(config, itemsize=4)
    assert costs.kv_bytes_per_token == (config.num_hidden_layers - linear) * 2 * 2 * 16 * 4
    conv = (2 * 2 * 16 + 4 * 16) * config.linear_conv_kernel_dim * 4
    recurrent = 4 * 16 * 16 * 4
    assert costs.state_bytes_per_sequence == linear * (conv + recurrent)


def test_7b_on_an_80_gib_card_decodes_resident_in_one_batch():
    plan = plan_generation(QWEN7B, 128, 64, 256, WEIGHTS_7B, 80 * GIB, 100 * GIB)
    assert plan.mode == "resident" and plan.batch_size == 128 and plan.kv_on_device and not plan.forced
    assert plan.kv_bytes == 128 * 320 * QWEN7B.kv_bytes_per_token
    text = plan.describe()
    assert "resident (chosen)" in text and "1 batch(es) of up to 128" in text and "80.00 GiB free" in text


def test_weights_that_do_not_fit_stream_with_the_largest_batch_that_fits():
    free = 8 * GIB  # less than the 12.2 GiB of layers
    plan = plan_generation(QWEN7B, 512, 64, 512, WEIGHTS_7B, free, None)
    assert plan.mode == "streamed" and plan.kv_on_device

    def need(b):
        per = (64 + 512) * QWEN7B.kv_bytes_per_token + 64 * QWEN7B.activation_bytes_per_token
        return b * (per + QWEN7B.logits_bytes_per_sequence)

    budget = free * 0.9
    assert need(plan.batch_size) <= budget < need(plan.batch_size + 1)  # the largest batch, by brute force
    assert plan.batches == -(-512 // plan.batch_size) > 1


def test_kv_cache_goes_to_host_memory_when_that_serves_more_prompts_per_pass():
    free = 4 * GIB
    device_only = plan_generation(QWEN7B, 512, 64, 2048, WEIGHTS_7B, free, None)
    with_host = plan_generation(QWEN7B, 512, 64, 2048, WEIGHTS_7B, free, 200 * GIB)
    assert device_only.kv_on_device and not with_host.kv_on_device
    assert with_host.batch_size > device_only.batch_size
    assert with_host.kv_bytes <= 200 * GIB
    assert "KV cache" in with_host.describe() and "on the host" in with_host.describe()


def test_forced_modes():
    streamed = plan_generation(QWEN7B, 16, 64, 32, WEIGHTS_7B, 80 * GIB, None, mode="streamed")
    assert streamed.mode == "streamed" and streamed.forced and streamed.batch_size == 16
    with pytest.raises(ValueError, match="generation='resident' needs the layer weights"):
        plan_generation(QWEN7B, 16, 64, 32, WEIGHTS_7B, 10 * GIB, None, mode="resident")
    with pytest.raises(ValueError, match="shorten max_new_tokens"):
        plan_generation(QWEN7B, 16, 64, 10**7, WEIGHTS_7B, 1 * GIB, None)
    with pytest.raises(ValueError, match="generation mode must be one of"):
        plan_generation(QWEN7B, 16, 64, 32, WEIGHTS_7B, 80 * GIB, None, mode="fast")
