"""The shipped LoRA and QLoRA recipes: their lora block reaches the module as peft's settings, they save adapters,
and the 72B QLoRA one fits an H200 with a 128 GiB host by lazytrain plan."""

import json

import pytest
import yaml
from test_cli_plan import plan

from lightning_lazytrain.sft.cli import main
from lightning_lazytrain.sft.lora import ALL_LINEAR, LoraOptions
from lightning_lazytrain.sft.module import CausalLMModule
from lightning_lazytrain.units import GIB


def test_lora_recipe_configures_adapters_over_a_bf16_base(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "qwen3.6-27b-lora", "--model.lora.r", "64", "--print_config"])
    assert exit_info.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["lora"] == {"r": 64, "alpha": 32, "dropout": 0.05, "target_modules": ALL_LINEAR,
                                    "quantize": "none", "build_device": "auto"}
    assert cfg["model"]["pretrained"] == "Qwen/Qwen3.6-27B" and cfg["trainer"]["precision"] == "bf16-mixed"
    (export,) = [c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("HFExportCallback")]
    assert export["init_args"]["merged_dirpath"] == "runs/qwen3.6-27b-lora/merged"


def test_module_wraps_its_model_with_the_lora_block():
    config = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    module = CausalLMModule(model_config=config, lora={"r": 2, "target_modules": ["q_proj"]})
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all(".q_proj.lora_" in n for n in trainable)
    assert module.model.peft_config["default"].r == 2
    with pytest.raises(ValueError, match="lora.r must be at least 1"):
        CausalLMModule(model_config=config, lora=LoraOptions(r=0))


def test_qlora_72b_recipe_configures_an_nf4_base_and_exports_only_the_adapters(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "qwen2.5-72b-qlora", "--print_config"])
    assert exit_info.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["lora"] == {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": ALL_LINEAR,
                                    "quantize": "nf4", "build_device": "auto"}
    assert cfg["model"]["pretrained"] == "Qwen/Qwen2.5-72B" and cfg["model"]["dtype"] == "bfloat16"
    assert cfg["trainer"]["precision"] == "bf16-mixed"
    (export,) = [c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("HFExportCallback")]
    assert export["init_args"]["dirpath"] == "runs/qwen2.5-72b-qlora/adapter"
    assert export["init_args"].get("merged_dirpath") is None, "a merged bf16 72B would not fit the host"


def test_qlora_72b_recipe_plan_fits_an_h200_with_a_128_gib_host(tmp_path):
    proc = plan(["--config", "qwen2.5-72b-qlora", "--gpu", "h200", "--host_ram_gib", "128", "--max_batch", "false",
                 "--json", "true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout)
    model, asked = answer["model"], answer["asked"]
    assert model["quantize"] == "nf4" and model["frozen_params"] == pytest.approx(72.7e9, rel=0.01)
    # r 16 on every linear layer of 80 layers: 16 * (in + out) per projection
    per_layer = 16 * (2 * (8192 + 8192) + 2 * (8192 + 1024) + 3 * (8192 + 29568))
    assert model["params"] == 80 * per_layer
    host = asked["tiers"]["host"]
    assert asked["fits"] and host["have_bytes"] == 128 * GIB
    packed = host["pieces"]["4-bit frozen weights"]
    linear = 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 29568)  # the weights quantized
    assert 0.5 * linear < packed < 0.53 * linear, "half a byte per weight, about 1/64 more for the quant state"
    assert host["pieces"]["master weights"] == 4 * model["params"], "fp32 masters for the adapters only"
