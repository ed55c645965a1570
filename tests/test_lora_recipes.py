"""The shipped LoRA recipe: its lora block reaches the module as peft's settings, and it saves adapters."""

import pytest
import yaml

from lightning_lazytrain.sft.cli import main
from lightning_lazytrain.sft.lora import ALL_LINEAR, LoraOptions
from lightning_lazytrain.sft.module import CausalLMModule


def test_lora_recipe_configures_adapters_over_a_bf16_base(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "qwen3.6-27b-lora", "--model.lora.r", "64", "--print_config"])
    assert exit_info.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["lora"] == {"r": 64, "alpha": 32, "dropout": 0.05, "target_modules": ALL_LINEAR,
                                    "quantize": "none"}
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
