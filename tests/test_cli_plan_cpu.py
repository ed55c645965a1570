"""``lazytrain plan`` for a run on the CPU (the demo's ``trainer.accelerator: cpu``, or no CUDA device and no
``--gpu``): planned for the CPU device as ``fit`` runs there, and said so. Before, it stopped asking for ``--gpu``."""

import json
import re

import pytest
import torch
from test_cli_plan import plan_in_process

DEMO_PARAMS = 9_830_272  # the demo shape's parameters (tied 151,669 x 64 embedding + 2 layers)


def test_the_demo_is_planned_for_the_cpu(tmp_path):
    proc = plan_in_process(
        ["--config", "demo", "--host_ram_gib", "8", "--max_batch", "false", "--json", "true"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout)
    device, asked = answer["gpu"], answer["asked"]
    assert device["name"] == "cpu" and device["bf16_tflops"] == 0.0  # no peak: no MFU is claimed
    assert device["source"].startswith("trainer.accelerator=cpu: planned for the CPU device, as fit runs on it")
    assert device["memory_bytes"] == answer["host"]["available_bytes"] == 8 << 30  # the device's memory is host RAM
    assert asked["fits"] and asked["schedule"]["homes"] == ["gpu"] * 3
    assert asked["tiers"]["host"]["pieces"]["master weights"] == 4 * DEMO_PARAMS  # fp32 masters (32-true)
    # the head's time is its FLOPs at 0.58 of the matmul rate measured here (printed to 4 digits)
    gflops = float(re.search(r"0\.58 of the ([\d.]+) GFLOP/s a 1024\^2 fp32 matmul", asked["scaling"]).group(1))
    head_flops = 6.0 * 151669 * 64 * (16 * 64)
    assert asked["prediction"]["head_s"] == pytest.approx(head_flops / (0.58 * gflops * 1e9), rel=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU here, the accelerator left to Lightning is it")
def test_no_cuda_and_no_gpu_named_plans_the_cpu_and_says_so(tmp_path):
    proc = plan_in_process(["--config", "demo", "--trainer.accelerator", "auto", "--max_batch", "false"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("CPU: ") and "(no CUDA device here and no --gpu: planned for the CPU device" in lines[1]
    assert "batch 16: fits" in proc.stdout and "model-TFLOPS per CPU" in proc.stdout
    assert "per GPU" not in proc.stdout and not any(line.startswith("GPU") for line in lines)


def test_a_named_gpu_wins_over_the_cpu_accelerator(tmp_path):
    proc = plan_in_process(["--config", "demo", "--gpu", "h100", "--max_batch", "false"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[1].startswith("GPU: NVIDIA H100 SXM 80 GB")
