"""``lazytrain fit --model.lora.r N``: LoRA from the command line, run as a process with this tree's package (the
refusal of an unknown quantize through the entry point in this process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_in_process import lazytrain_in_process

from lightning_lazytrain.sft.cli import DEMO_RECIPE

ROOT = Path(__file__).resolve().parents[1]
FEW_STEPS = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--data.max_eval_samples", "8",
             "--data.eval_batch_size", "8", "--model.max_generate_samples", "8", "--model.max_new_tokens", "4"]


def lazytrain(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys; from lightning_lazytrain.sft.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def test_lora_rank_from_the_command_line_trains_only_the_adapters(tmp_path):
    proc = lazytrain(["fit", "--config", str(DEMO_RECIPE), *FEW_STEPS, "--model.lora.r", "4",
                      "--model.lora.target_modules", "[q_proj, v_proj]", "--trainer.enable_checkpointing", "true",
                      "--trainer.logger.init_args.save_dir", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ckpt,) = tmp_path.rglob("*.ckpt")
    state = torch.load(ckpt, weights_only=False)
    keys = set(state["state_dict"])
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), sorted(keys)[:4]
    assert {k.split(".lora_")[0].rsplit(".", 1)[1] for k in keys} == {"q_proj", "v_proj"}
    assert state["state_dict"][next(k for k in keys if ".lora_A." in k)].shape[0] == 4
    saved = state["hyper_parameters"]["lora"]
    assert (saved["r"] if isinstance(saved, dict) else saved.r) == 4


def test_qlora_from_the_command_line_trains_adapters_over_a_4bit_base(tmp_path):
    proc = lazytrain(["fit", "--config", str(DEMO_RECIPE), *FEW_STEPS, "--model.lora.r", "4",
                      "--model.lora.quantize", "nf4", "--trainer.enable_checkpointing", "true",
                      "--trainer.logger.init_args.save_dir", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ckpt,) = tmp_path.rglob("*.ckpt")
    state = torch.load(ckpt, weights_only=False)
    keys = set(state["state_dict"])
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), sorted(keys)[:4]
    assert not any("absmax" in k or "quant_state" in k for k in keys), "nothing of the 4-bit base is saved"
    saved = state["hyper_parameters"]["lora"]
    assert (saved["quantize"] if isinstance(saved, dict) else saved.quantize) == "nf4"


def test_an_unknown_quantize_is_refused_before_loading(tmp_path):
    proc = lazytrain_in_process(["fit", "--config", str(DEMO_RECIPE), *FEW_STEPS, "--model.lora.quantize", "int3"],
                                tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "nf4" in proc.stderr + proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a machine without CUDA")
def test_a_cuda_build_without_cuda_is_refused_before_loading(tmp_path):
    proc = lazytrain(["fit", "--config", str(DEMO_RECIPE), *FEW_STEPS, "--model.lora.quantize", "nf4",
                      "--model.lora.build_device", "cuda"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "lora.build_device is cuda but CUDA is not available" in proc.stderr
