"""``lora.build_device``: where the SFT module's 4-bit (QLoRA) base is materialised and quantized layer by layer.
It parses from a recipe and the command line, ``cuda`` without CUDA is refused at setup naming it, and ``auto``
without CUDA builds the CPU build's bytes exactly."""

from pathlib import Path

import pytest
import torch
import yaml
from cli_in_process import lazytrain_in_process
from qlora_models import BUILD_SHAPE, build_config, host_only, packed_base

import lightning_lazytrain.models.layerwise as layerwise
import lightning_lazytrain.sft.model_loading as model_loading
import lightning_lazytrain.sft.module as module_file
from lightning_lazytrain.sft.cli import DEMO_RECIPE, main
from lightning_lazytrain.sft.data.sft import SFTDataModule
from lightning_lazytrain.sft.lora import LoraOptions, layer_build_device
from lightning_lazytrain.sft.module import CausalLMModule


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _printed_lora(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(DEMO_RECIPE), *args, "--print_config"])
    assert stop.value.code == 0, capsys.readouterr().err[-3000:]
    return yaml.safe_load(capsys.readouterr().out)["model"]["lora"]


def test_build_device_parses_from_a_recipe_and_the_command_line(tmp_path, capsys):
    recipe = tmp_path / "qlora.yaml"
    recipe.write_text("model:\n  lora:\n    quantize: nf4\n    build_device: cpu\n")
    assert _printed_lora(["--config", str(recipe)], capsys)["build_device"] == "cpu"
    assert _printed_lora(["--model.lora.quantize", "nf4", "--model.lora.build_device", "cuda"], capsys) == {
        **vars(LoraOptions(quantize="nf4")),
        "build_device": "cuda",
    }
    assert _printed_lora(["--model.lora.r", "4"], capsys)["build_device"] == "auto"
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(DEMO_RECIPE), "--model.lora.build_device", "gpu", "--print_config"])
    assert stop.value.code == 2
    assert "build_device" in capsys.readouterr().err


def test_cuda_without_cuda_exits_2_at_setup_naming_the_option(tmp_path, monkeypatch, no_cuda):
    reached = []
    monkeypatch.setattr(module_file, "build_quantized_model", lambda *a, **k: reached.append("model build"))
    for step in ("prepare_data", "setup"):  # where the data is tokenized
        monkeypatch.setattr(SFTDataModule, step, lambda *a, step=step, **k: reached.append(step))
    proc = lazytrain_in_process(
        [
            "fit",
            "--config",
            str(DEMO_RECIPE),
            "--model.lora.quantize",
            "nf4",
            "--model.lora.build_device",
            "cuda",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
        ],
        Path.cwd(),
    )
    err = proc.stderr
    assert proc.returncode == 2, err[-3000:]
    assert "lora.build_device is cuda but CUDA is not available" in err
    assert "--model.lora.build_device cpu" in err
    assert reached == [] and list(tmp_path.iterdir()) == []


def test_a_build_device_that_cannot_be_used_is_refused_naming_the_options():
    shape = dict(model_type="qwen2", **BUILD_SHAPE)
    with pytest.raises(ValueError, match="lora.build_device: cuda .* lora.quantize is none"):
        CausalLMModule(model_config=shape, lora={"build_device": "cuda"})
    with pytest.raises(ValueError, match="lora.build_device must be auto, cpu or cuda, got 'gpu'"):
        CausalLMModule(model_config=shape, lora={"quantize": "nf4", "build_device": "gpu"})


def test_auto_without_cuda_builds_the_cpu_builds_bytes(monkeypatch, no_cuda):
    torch.manual_seed(0)
    reference = packed_base(layerwise.build_quantized(build_config(), "nf4", torch.float32))
    devices = []
    real = layerwise._build_device
    monkeypatch.setattr(layerwise, "_build_device", lambda device: devices.append(device) or real(device))
    torch.manual_seed(0)
    module = CausalLMModule(model_config=dict(model_type="qwen2", **BUILD_SHAPE), lora={"r": 4, "quantize": "nf4"})
    built = module.model
    assert devices == [torch.device("cpu")]
    assert host_only(built)
    got = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v for k, v in packed_base(built).items()}
    assert got.keys() == reference.keys() and len(got) == 3 * 7 * 4
    assert all(torch.equal(got[k], reference[k]) for k in reference)


def test_auto_with_cuda_hands_the_gpu_to_the_layer_build(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    devices = []

    def on_the_cpu(*args, device):  # records where the module asked for the build, and builds on the CPU here
        devices.append(device)
        return layerwise.build_quantized(*args)

    monkeypatch.setattr(model_loading, "build_quantized", on_the_cpu)
    module = CausalLMModule(model_config=dict(model_type="qwen2", **BUILD_SHAPE), lora={"r": 4, "quantize": "fp4"})
    assert host_only(module.model)
    assert devices == [torch.device("cuda")]


@pytest.mark.parametrize(
    ("build_device", "run_device", "expected"),
    [
        ("auto", None, "cuda"),  # outside a Trainer: the GPU CUDA offers
        ("auto", "cuda:1", "cuda:1"),  # the run's own GPU
        ("auto", "cpu", "cpu"),  # a CPU run on a machine with a GPU leaves the GPU alone
        ("cuda", "cpu", "cuda"),  # asked for
        ("cuda", "cuda:1", "cuda:1"),
        ("cpu", "cuda:1", "cpu"),
        ("cpu", None, "cpu"),
    ],
)
def test_where_the_layers_are_built_with_cuda_available(monkeypatch, build_device, run_device, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    options = LoraOptions(quantize="nf4", build_device=build_device)
    run = torch.device(run_device) if run_device else None
    assert layer_build_device(options, run) == torch.device(expected)


def test_auto_without_cuda_outside_a_trainer_is_the_cpu(no_cuda):
    assert layer_build_device(LoraOptions(quantize="fp4"), None) == torch.device("cpu")
