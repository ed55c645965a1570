"""``lazytrain plan``, offline (the model comes from its shape): the installed console script run as a process for
an answer (exit 0) and a usage error (exit 2), the other plans through its entry point in this process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_in_process import lazytrain_in_process

from lightning_lazytrain.sft.plan_model import model_config

RECIPE_7B = "qwen2.5-7b"  # a shipped recipe, by name
LAZYTRAIN = Path(sys.executable).with_name("lazytrain")


def offline(cwd: Path) -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "HF_HOME": str(cwd / "hf")}  # an empty hub cache, no network


def plan(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    assert LAZYTRAIN.is_file(), f"{LAZYTRAIN} missing: install the package (pip install -e .) before testing"
    env = {**os.environ, **offline(cwd)}
    return subprocess.run(
        [str(LAZYTRAIN), "plan", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def plan_in_process(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return lazytrain_in_process(["plan", *args], cwd, env=offline(cwd))


def test_plan_of_the_7b_recipe_on_an_h200(tmp_path):
    proc = plan(["--config", str(RECIPE_7B), "--gpu", "h200", "--host_ram_gib", "120"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "Qwen2ForCausalLM, 28 layers, 7.62 B parameters" in out and "published shape 'qwen2.5-7b'" in out
    # the verdict also counts this machine's free disk for checkpoints: check the GPU and host lines instead
    # the strategy's plan: no boundary recomputed, some graphs kept; the GPU tier is the plan's device memory, the
    # resident embeddings/head copy (2 x (2 x 152064 + 1) x 3584 B) and the 5% margin of the 138.37 GiB left
    plan_line = re.search(r"boundaries gpu \d+, cpu (\d+), nvme 0, recompute 0; graphs kept [1-9]", out)
    assert "batch 144: " in out and plan_line, out
    assert re.search(r"GPU +resident parts +2\.03\n", out) and re.search(r"GPU +allocator margin +6\.92\n", out), out
    assert re.search(r"GPU +need / have +1[1-3]\d\.\d\d / 140\.40  ok", out), out
    # 7.62 B parameters x (4 + 2 + 2 + 7.88) B, and 144 x 1024 x 3584 bf16 values per CPU-homed boundary
    host = re.search(r"host RAM +need / have +(\d+\.\d\d) / 120\.00  ok", out)
    cpu_homed = int(plan_line.group(1)) * 144 * 1024 * 3584 * 2 / 2**30
    assert host and float(host.group(1)) == pytest.approx(112.63 + cpu_homed, abs=0.011), out
    assert "0.58 of h200's 989 dense bf16 peak" in out and "largest batch the GPU takes: " in out
    assert "Traceback" not in proc.stderr and "Seed set" not in proc.stderr + out


def test_an_unknown_gpu_is_a_usage_error(tmp_path):
    proc = plan(["--config", str(RECIPE_7B), "--gpu", "tpu-v5"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "unknown GPU 'tpu-v5': --gpu takes one of h200, h100, a100-80gb, l40s, rtx4090, rtx3090" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU here, the plan is for it (see the gpu test)")
def test_a_gpu_recipe_with_no_gpu_here_and_none_named_is_a_usage_error(tmp_path):
    # its trainer.accelerator is gpu (a CPU run: test_cli_plan_cpu)
    proc = plan_in_process(["--config", str(RECIPE_7B)], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device here: name the GPU to plan for with --gpu (h200, h100" in proc.stderr
    assert "or plan the CPU with --trainer.accelerator cpu" in proc.stderr


def test_json_answer_follows_the_overrides(tmp_path):
    proc = plan_in_process(
        [
            "--config",
            str(RECIPE_7B),
            "--gpu",
            "rtx4090",
            "--data.batch_size",
            "4",
            "--trainer.devices",
            "2",
            "--data.max_seq_length",
            "512",
            "--max_batch",
            "false",
            "--json",
            "true",
            "--host_ram_gib",
            "200",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout)
    assert answer["asked"]["batch"] == 4 and answer["run"]["seq"] == 512 and answer["run"]["world_size"] == 2
    assert answer["largest"] is None and not answer["largest_searched"] and answer["gpu"]["memory_bytes"] == 24564 << 20
    from lightning_lazytrain.models.fused_kernels import liger_available

    # the recipe leaves fused_kernels at "auto": Liger's kernels where liger-kernel is installed, as in the run
    assert answer["run"]["kernels"] == ("Liger's fused norm, SwiGLU and RoPE" if liger_available() else "HF's own")
    host = answer["asked"]["tiers"]["host"]["pieces"]
    # two processes on one host: the streamed copy once, everything else as the two ranks' shards (all of it)
    assert host["streamed copy (shared, once per host)"] == 2 * answer["model"]["params"]
    # the recipe's ResumableModelCheckpoint: fp32 masters + states, save_top_k=2 (last.ckpt a link) and one more
    # while the next one is written; a 7B full-state checkpoint is "about 90 GB" (issue 14)
    (ckpt,) = answer["asked"]["tiers"]["checkpoint"]["pieces"].values()
    assert ckpt == 3 * int(answer["model"]["params"] * (4 + 8 - 6 * 0.02)) and ckpt / 3 == pytest.approx(90e9, rel=0.02)
    # the update rate: HybridAdamW's, measured on this host's kernel path with the recipe's 2% 8-bit states
    from lightning_lazytrain.optim import kernel_path
    from lightning_lazytrain.optim.update_rate import host_update_rate

    assert answer["host"]["update_source"] == f"HybridAdamW measured here, kernel path {kernel_path()}"
    assert answer["host"]["update_params_per_s"] == pytest.approx(host_update_rate(0.02)[0])  # the cached rate
    assert answer["asked"]["prediction"]["update_s"] == pytest.approx(
        answer["model"]["params"] / answer["host"]["update_params_per_s"]
    )


def test_a_hub_name_with_no_config_anywhere_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    config, source = model_config("Qwen/Qwen2.5-14B", None)
    assert config.num_hidden_layers == 48 and "published shape 'qwen2.5-14b'" in source
    with pytest.raises(ValueError, match="model.model_config with one of qwen2.5-3b"):
        model_config("someone/unknown-model", None)
    local = tmp_path / "local"
    config.save_pretrained(local)
    assert model_config(str(local), None) == (config.__class__.from_pretrained(local), str(local))


@pytest.mark.gpu
def test_plan_with_the_gpu_here_measures_it(tmp_path):
    recipe = "qwen2.5-3b"  # a shipped recipe, by name
    proc = plan(["--config", str(recipe), "--data.batch_size", "8", "--json", "true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout)
    assert answer["asked"]["scaling"].startswith("measured on NVIDIA") and answer["asked"]["fits_gpu"]
    assert answer["largest"]["batch"] > 8 and answer["largest"]["prediction"]["step_s"] > 0


def test_the_plan_names_the_kernels_the_layers_will_run():
    import torch
    from helpers import tiny_config
    from transformers import AutoModelForCausalLM

    from lightning_lazytrain.models.adapter import adapter_for
    from lightning_lazytrain.schedule.forecast import RunSpec
    from lightning_lazytrain.sft.plan_command import _kernels

    def run(family: str, mode: str) -> RunSpec:
        with torch.device("meta"):
            return RunSpec(adapter_for(AutoModelForCausalLM.from_config(tiny_config(family))), 64, fused_kernels=mode)

    assert _kernels(run("qwen2", "liger")) == "Liger's fused norm, SwiGLU and RoPE"
    assert _kernels(run("qwen3-moe", "liger")) == "Liger's fused norm and RoPE"
    assert _kernels(run("qwen2", "none")) == "HF's own"
    assert _kernels(run("qwen3.5", "liger")) == "HF's own (Liger's kernels cover no layer of this family)"


def test_a_batch_whose_layers_fit_only_in_slices_is_planned_in_slices(tmp_path):
    """The 7B recipe at batch 96 under a 24 GiB cap: with whole-batch layers the largest layer's working set does
    not fit (the note names layer_micro_batches); by default the plan takes row slices and fits."""
    common = ["--config", str(RECIPE_7B), "--gpu", "h100", "--gpu_memory_gib", "24", "--data.batch_size", "96",
              "--host_ram_gib", "200"]
    whole = plan_in_process(
        [*common, "--max_batch", "false", "--trainer.strategy.init_args.layer_micro_batches", "1"], tmp_path
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "no plan fits" in whole.stdout and "run each layer in more row slices (layer_micro_batches)" in whole.stdout
    auto = plan_in_process(common, tmp_path)
    assert auto.returncode == 0, auto.stderr[-3000:]
    sliced = re.search(r"graphs kept \d+; each layer in (\d+) row slices \((\d+) rows at most\)", auto.stdout)
    assert sliced and int(sliced.group(1)) > 1 and int(sliced.group(2)) == -(-96 // int(sliced.group(1))), auto.stdout
    assert "no plan fits" not in auto.stdout
    # the largest batch says its slices: its predicted time is the whole batch's, which small slices may not reach
    assert re.search(r"largest batch the GPU takes: \d+ in \d+ layer row slices \(predicted", auto.stdout), auto.stdout


@pytest.mark.parametrize("proxy", [False, True])
def test_a_machine_without_a_network_falls_back_without_asking_the_hub(tmp_path, monkeypatch, proxy):
    """No HF_HUB_OFFLINE, no route to the hub: the hub client would retry for about 25 s; the plan asks it nothing
    and falls back to the published shape at once. Behind a proxy no direct connection is tried and the hub is
    asked (here it fails too, and the fallback is the same)."""
    from lightning_lazytrain.sft import plan_model

    for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    if proxy:
        monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    tried, asked = [], []

    def no_route(address, timeout):
        tried.append((address, timeout))
        raise OSError("[Errno -2] Name or service not known")

    def from_pretrained(name, trust_remote_code=False, local_files_only=False):
        asked.append(local_files_only)
        raise OSError(f"no config.json for {name}")

    monkeypatch.setattr(plan_model.socket, "create_connection", no_route)
    monkeypatch.setattr(plan_model.AutoConfig, "from_pretrained", from_pretrained)
    config, source = model_config("Qwen/Qwen2.5-7B", None)
    assert config.num_hidden_layers == 28 and source.startswith("published shape 'qwen2.5-7b'")
    assert tried == ([] if proxy else [(("huggingface.co", 443), 3)])
    assert asked == ([True, False] if proxy else [True])  # the cache, then the hub only behind the proxy
    with pytest.raises(ValueError, match="huggingface.co:443 cannot be reached" if not proxy else "no config.json"):
        model_config("someone/unknown-model", None)
