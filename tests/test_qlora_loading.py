"""A 4-bit base is built layer by layer: from safetensors shards or random init, never holding the whole
full-precision model, and from shards with the same 4-bit bytes as quantizing the whole model."""

import copy

import pytest
import torch
from helpers import tiny_model
from qlora_models import packed_base
from transformers import AutoModelForCausalLM, Qwen2Config

import lightning_lazytrain.models.layerwise as layerwise
from lightning_lazytrain.engine.weights.packed4bit import is_packed_4bit
from lightning_lazytrain.models.quantize import quantize_layers
from lightning_lazytrain.sft.module import CausalLMModule

LAYERS = 8


def _config() -> Qwen2Config:
    return Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2)


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params if not p.is_meta)


class _Peak:
    """The largest number of parameter bytes the model under construction held after any materialising step."""

    def __init__(self, monkeypatch) -> None:
        self.peak, self.calls = 0, 0
        real = layerwise._materialise

        def spy(model, *args):
            real(model, *args)
            self.calls += 1
            self.peak = max(self.peak, _bytes(model.parameters()))

        monkeypatch.setattr(layerwise, "_materialise", spy)


@pytest.mark.parametrize("source", ["random-init", "safetensors"])
def test_the_load_peak_is_the_4bit_model_plus_one_full_precision_layer(monkeypatch, tmp_path, source):
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(_config())
    whole, layer = _bytes(full.parameters()), max(_bytes(m.parameters()) for m in full.model.layers)
    if source == "safetensors":
        full.save_pretrained(tmp_path)
    peak = _Peak(monkeypatch)
    built = layerwise.build_quantized(full.config, "nf4", torch.float32, str(tmp_path) if source != "random-init"
                                      else None)
    held = _bytes({id(p): p for p in built.parameters()}.values())
    assert peak.calls == LAYERS + 1, "each layer on its own, then the rest"
    assert peak.peak <= held + layer, "never more than the finished 4-bit model and one full-precision layer"
    assert peak.peak < 0.6 * whole
    assert sum(is_packed_4bit(p) for p in built.parameters()) == 7 * LAYERS


def test_from_shards_the_4bit_bytes_equal_quantizing_the_whole_model(tmp_path):
    full = tiny_model("qwen2-tied")
    full.save_pretrained(tmp_path)
    whole = copy.deepcopy(full)
    quantize_layers(whole.model.layers, "fp4", torch.float32)
    built = layerwise.build_quantized(full.config, "fp4", torch.float32, str(tmp_path))
    assert built.lm_head.weight is built.model.embed_tokens.weight
    ref, got = packed_base(whole), packed_base(built)
    assert ref.keys() == got.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    ids = torch.randint(0, 512, (2, 12))
    assert float(built(input_ids=ids, labels=ids).loss) == pytest.approx(float(whole(input_ids=ids, labels=ids).loss))


def test_random_init_is_the_models_own_initialisation(monkeypatch):
    config = _config()
    peak = _Peak(monkeypatch)
    module = CausalLMModule(model_config=config.to_dict(), lora={"r": 2, "quantize": "nf4"})
    model = module.model
    assert peak.calls == LAYERS + 1, "the module builds a QLoRA base layer by layer"
    norms = [p for n, p in model.named_parameters() if n.endswith("layernorm.weight")]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    std = float(model.get_input_embeddings().weight.std())
    assert std == pytest.approx(config.initializer_range, rel=0.1)
    assert torch.isfinite(model.base_model.model.model.rotary_emb.inv_freq).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_a_gpu_build_without_cuda_is_refused_before_any_layer_is_built(monkeypatch):
    peak = _Peak(monkeypatch)
    with pytest.raises(ValueError, match="CUDA is not available here.*device='cpu'"):
        layerwise.build_quantized(_config(), "nf4", torch.float32, device="cuda")
    with pytest.raises(ValueError, match="built on 'cpu' or 'cuda'"):
        layerwise.build_quantized(_config(), "nf4", torch.float32, device="meta")
    assert peak.calls == 0
