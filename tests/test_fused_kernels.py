"""Which modules the Liger kernels are bound to, and that nothing of the model changes but those forwards.

The kernels themselves run only on CUDA (Triton): their numbers against HF's are in ``test_gpu_fused_kernels.py``.
"""

import copy

import pytest
import torch
from helpers import FAMILIES, batches, tiny_model, train

from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.models import adapter_for
from lightning_lazytrain.models.fused_kernels import (
    fuse_decoder_kernels,
    liger_available,
    unfuse_decoder_kernels,
    use_fused_kernels,
)

# per decoder layer: the two norms, the MLP and the attention (its RoPE); Qwen3's attention adds q_norm and k_norm;
# the MoE block is not a SwiGLU MLP; Qwen3.5's norms scale by 1 + weight, which Liger's "llama" mode does not
# compute, and its attention rotates part of each head
BOUND_PER_LAYER = {"qwen2": 4, "qwen2-tied": 4, "qwen3": 6, "qwen3-moe": 5, "qwen3.5": 0, "llama": 4}


def _bound(layers) -> list[str]:
    return [type(m).__name__ for layer in layers for m in layer.modules() if "forward" in m.__dict__]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_norms_and_swiglu_mlps_of_each_layer_are_bound_and_unbound(family):
    model = tiny_model(family)
    layers = adapter_for(model).layers
    before = copy.deepcopy(model.state_dict())
    count = fuse_decoder_kernels(layers)
    assert count == BOUND_PER_LAYER[family] * len(layers) == len(_bound(layers))
    assert all(name.endswith(("RMSNorm", "MLP", "Attention")) for name in _bound(layers))
    unfuse_decoder_kernels(layers)
    assert _bound(layers) == []
    assert all(torch.equal(t, before[k]) for k, t in model.state_dict().items())


def test_a_copied_layer_runs_its_own_weights():
    """The profiler deep-copies a layer onto the device: the copy's fused forwards must read the copy."""
    layer = adapter_for(tiny_model("qwen2")).layers[0]
    fuse_decoder_kernels([layer])
    twin = copy.deepcopy(layer)
    assert twin.mlp.forward.__self__ is twin.mlp
    assert twin.input_layernorm.forward.__self__ is twin.input_layernorm


def test_someone_elses_override_is_left_alone():
    layer = adapter_for(tiny_model("qwen2")).layers[0]

    def theirs(x):
        return x

    layer.mlp.forward = theirs
    assert fuse_decoder_kernels([layer]) == 3
    unfuse_decoder_kernels([layer])
    assert layer.mlp.forward is theirs


def test_the_mode_resolves_per_device():
    assert use_fused_kernels("none", "cuda") is False
    assert use_fused_kernels("auto", "cpu") is False
    assert use_fused_kernels("auto", "cuda") is liger_available()
    with pytest.raises(ValueError, match="fused_kernels='liger' needs a CUDA device.*the device is cpu"):
        use_fused_kernels("liger", "cpu")
    with pytest.raises(ValueError, match="fused_kernels='fast': choose 'auto', 'liger' or 'none'"):
        LazyTrainStrategy(fused_kernels="fast")


def test_liger_on_the_cpu_accelerator_stops_at_setup():
    with pytest.raises(ValueError, match="fused_kernels='liger' needs a CUDA device"):
        train(tiny_model("qwen2"), batches(1), strategy=LazyTrainStrategy(fused_kernels="liger"), max_steps=1)


def test_a_profile_measured_with_fused_kernels_is_cached_apart():
    from lightning_lazytrain.schedule.profile import cache_key

    adapter = adapter_for(tiny_model("qwen2"))
    before = cache_key(adapter, 2, 16, torch.device("cpu"), torch.float32)
    fuse_decoder_kernels(adapter.layers)
    after = cache_key(adapter, 2, 16, torch.device("cpu"), torch.float32)
    assert before["fused_kernels"] == 0 and after["fused_kernels"] == 16 and before != after


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # Qwen3's attention runs its q/k norms through Triton too
def test_the_rope_kernel_replaces_hfs_only_inside_the_bound_attention(family, monkeypatch):
    """Liger's RoPE needs Triton, so a stand-in records the calls: the fused attention must route its rotation
    through the kernel, give HF's output, and leave the module's global HF's after the call, even one that fails."""
    import sys

    from lightning_lazytrain.models import fused_kernels

    model = tiny_model(family)
    attention = adapter_for(model).layers[0].self_attn
    modeling = sys.modules[type(attention).__module__]
    hf_rope, calls = modeling.apply_rotary_pos_emb, []

    def kernel(q, k, cos, sin):
        calls.append(q.shape)
        return hf_rope(q, k, cos, sin)

    monkeypatch.setattr(fused_kernels, "_rope_kernel", lambda: kernel)
    hidden = torch.randn(2, 5, model.config.hidden_size)
    rotary = model.model.rotary_emb(hidden, torch.arange(5).unsqueeze(0))
    expected, _ = attention(hidden, rotary, None)
    fuse_decoder_kernels(adapter_for(model).layers)
    got, _ = attention(hidden, rotary, None)
    assert len(calls) == 1 and modeling.apply_rotary_pos_emb is hf_rope
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        attention(hidden[:, :, :-1], rotary, None)
    assert modeling.apply_rotary_pos_emb is hf_rope


@pytest.mark.parametrize(("mode", "kernel"), [("auto", None), ("none", False)])
def test_none_also_keeps_the_head_loss_off_triton(mode, kernel, monkeypatch):
    """``fused_kernels="none"`` is the way to run no Triton kernel at all, the loss's own included."""
    from lightning_lazytrain.engine.compute import hooks

    seen, real = [], hooks.chunked_causal_lm_loss

    def spy(*args, **kwargs):
        seen.append(args[5])
        return real(*args, **kwargs)

    monkeypatch.setattr(hooks, "chunked_causal_lm_loss", spy)
    train(tiny_model("qwen2"), batches(1), strategy=LazyTrainStrategy(fused_kernels=mode), max_steps=1)
    assert seen and set(seen) == {kernel}
