"""The layer-by-layer 4-bit build on the GPU (``build_quantized(device="cuda")``): the model it hands back is on the
host, whole, with the 4-bit bytes the CPU build makes from the same shards, and the GPU holds nothing afterwards."""

import pytest
import torch
from qlora_models import packed_base
from transformers import AutoModelForCausalLM, Qwen2Config

import lightning_lazytrain.models.layerwise as layerwise
from lightning_lazytrain.engine.weights.packed4bit import is_packed_4bit

pytestmark = pytest.mark.gpu
LAYERS = 4
LEFT_ON_GPU = 2**16  # bitsandbytes keeps its 8-bit code map on the first device it quantizes on; a layer is 4 MB


def _config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )


def _host_only(model) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    states = [p.quant_state for p in model.parameters() if getattr(p, "quant_state", None) is not None]
    tensors += [t for s in states for t in (s.absmax, s.code, s.state2.absmax, s.state2.code)]
    return all(t.device.type == "cpu" for t in tensors)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_from_shards_the_gpu_build_matches_the_cpu_build(tmp_path, quant_type):
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(_config())
    full.save_pretrained(tmp_path)
    before = torch.cuda.memory_allocated()
    on_gpu = layerwise.build_quantized(full.config, quant_type, torch.float32, str(tmp_path), device="cuda")
    assert torch.cuda.memory_allocated() - before < LEFT_ON_GPU, "nothing of the build is left on the GPU"
    on_cpu = layerwise.build_quantized(full.config, quant_type, torch.float32, str(tmp_path))
    assert _host_only(on_gpu)
    assert on_gpu.lm_head.weight is on_gpu.model.embed_tokens.weight
    ref, got = packed_base(on_cpu), packed_base(on_gpu)
    assert ref.keys() == got.keys()
    codes = [k for k in ref if not k.endswith("absmax")]
    same = sum(int((got[k] == ref[k]).sum()) for k in codes) / sum(ref[k].numel() for k in codes)
    assert same > 0.999, "bitsandbytes' CUDA and CPU kernels pick the same 4-bit code but for rare ties"
    ids = torch.randint(0, 512, (2, 12))
    loss_gpu, loss_cpu = (float(m(input_ids=ids, labels=ids).loss) for m in (on_gpu, on_cpu))
    assert loss_gpu == pytest.approx(loss_cpu, rel=1e-3)


def test_random_init_on_the_gpu_is_the_models_own_initialisation():
    config = _config()
    built = layerwise.build_quantized(config, "nf4", torch.float32, device="cuda")
    assert _host_only(built)
    assert sum(is_packed_4bit(p) for p in built.parameters()) == 7 * LAYERS
    norms = [p for n, p in built.named_parameters() if n.endswith("layernorm.weight")]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    std = float(built.get_input_embeddings().weight.std())
    assert std == pytest.approx(config.initializer_range, rel=0.1)
    reference = AutoModelForCausalLM.from_config(config)
    assert torch.allclose(built.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
