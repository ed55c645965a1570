"""The layer-by-layer 4-bit build on the GPU (``build_quantized(device="cuda")``): the model it hands back is on the
host, whole, with the 4-bit bytes the CPU build makes from the same shards, and the GPU holds nothing afterwards;
the SFT module's ``lora.build_device`` (cuda, or auto outside a Trainer) builds the same bytes through that path."""

import pytest
import torch
from qlora_models import BUILD_LAYERS, build_config, host_only, packed_base
from transformers import AutoModelForCausalLM

import lightning_lazytrain.models.layerwise as layerwise
from lightning_lazytrain.engine.weights.packed4bit import is_packed_4bit
from lightning_lazytrain.sft.module import CausalLMModule

pytestmark = pytest.mark.gpu
LEFT_ON_GPU = 2**16  # bitsandbytes keeps its 8-bit code map on the first device it quantizes on; a layer is 4 MB
LAYER_ON_GPU = 2**21  # half of one fp32 decoder layer of the tiny model (3.9 MB)


def _same_codes(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """The share of equal 4-bit codes of two `packed_base` results (bitsandbytes' CUDA and CPU kernels pick the
    same code but for rare ties)."""
    assert ref.keys() == got.keys()
    codes = [k for k in ref if not k.endswith("absmax")]
    return sum(int((got[k] == ref[k]).sum()) for k in codes) / sum(ref[k].numel() for k in codes)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_from_shards_the_gpu_build_matches_the_cpu_build(tmp_path, quant_type):
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(build_config())
    full.save_pretrained(tmp_path)
    before = torch.cuda.memory_allocated()
    on_gpu = layerwise.build_quantized(full.config, quant_type, torch.float32, str(tmp_path), device="cuda")
    assert torch.cuda.memory_allocated() - before < LEFT_ON_GPU, "nothing of the build is left on the GPU"
    on_cpu = layerwise.build_quantized(full.config, quant_type, torch.float32, str(tmp_path))
    assert host_only(on_gpu)
    assert on_gpu.lm_head.weight is on_gpu.model.embed_tokens.weight
    assert _same_codes(packed_base(on_cpu), packed_base(on_gpu)) > 0.999
    ids = torch.randint(0, 512, (2, 12))
    loss_gpu, loss_cpu = (float(m(input_ids=ids, labels=ids).loss) for m in (on_gpu, on_cpu))
    assert loss_gpu == pytest.approx(loss_cpu, rel=1e-3)


@pytest.mark.parametrize("build_device", ["cuda", "auto"])
def test_the_modules_build_device_builds_on_the_gpu_the_cpu_builds_bytes(tmp_path, build_device):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config()).save_pretrained(tmp_path)

    def adapted(device: str) -> torch.nn.Module:  # as LightningCLI hands the module its lora block: a dict
        return CausalLMModule(pretrained=str(tmp_path), lora={"r": 4, "quantize": "nf4", "build_device": device}).model

    def built_with_gpu_peak(device: str) -> tuple[torch.nn.Module, int]:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model = adapted(device)
        return model, torch.cuda.max_memory_allocated() - before

    on_gpu, gpu_peak = built_with_gpu_peak(build_device)
    assert gpu_peak >= LAYER_ON_GPU, "the layers were materialised on the GPU"
    on_cpu, cpu_peak = built_with_gpu_peak("cpu")
    assert cpu_peak < LEFT_ON_GPU, "lora.build_device: cpu leaves the GPU alone"
    assert host_only(on_gpu)
    assert _same_codes(packed_base(on_cpu), packed_base(on_gpu)) > 0.999


def test_random_init_on_the_gpu_is_the_models_own_initialisation():
    config = build_config()
    built = layerwise.build_quantized(config, "nf4", torch.float32, device="cuda")
    assert host_only(built)
    assert sum(is_packed_4bit(p) for p in built.parameters()) == 7 * BUILD_LAYERS
    norms = [p for n, p in built.named_parameters() if n.endswith("layernorm.weight")]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    std = float(built.get_input_embeddings().weight.std())
    assert std == pytest.approx(config.initializer_range, rel=0.1)
    reference = AutoModelForCausalLM.from_config(config)
    assert torch.allclose(built.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
