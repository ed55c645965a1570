"""The plan's profile of a LoRA / QLoRA model (issue 38): a frozen layer's backward computes input gradients only
(plus its adapters' weight gradients), sends back and keeps only the adapters' gradients, and a 4-bit base streams
its packed bytes. Checked against FLOPs and bytes counted by hand on a tiny Qwen2; with every weight trainable the
numbers are what they were (twice the forward, every parameter's gradient)."""

from __future__ import annotations

import re

import pytest
import torch
from forecast_helpers import H200, meta, named
from helpers import tiny_config, tiny_model
from lora_models import tiny_lora
from qlora_models import tiny_qlora

from lightning_lazytrain.engine import Schedule
from lightning_lazytrain.models.adapter import adapter_for
from lightning_lazytrain.schedule import profile_model
from lightning_lazytrain.schedule.analytic import ACHIEVED_FRACTION, analytic_profile
from lightning_lazytrain.schedule.build import build_problem
from lightning_lazytrain.schedule.device_profile import measured_profile
from lightning_lazytrain.schedule.forecast import Machine, RunSpec, forecast, plan_inputs
from lightning_lazytrain.schedule.profile import ANALYTIC_FLOPS, SOURCE_KEYS, Profile
from lightning_lazytrain.schedule.step_time import predict_step
from lightning_lazytrain.sft.cli import main as lazytrain
from lightning_lazytrain.sft.lora import LoraOptions, add_adapters
from lightning_lazytrain.sft.plan_machine import gpu_machine
from lightning_lazytrain.sft.plan_model import meta_model

CPU = torch.device("cpu")
H, INTER, KV, VOCAB, BATCH, SEQ = 64, 128, 32, 512, 3, 32
TOKENS = BATCH * SEQ
# a Qwen2 layer by hand: q/k/v with biases, o without, gate/up/down, two norms
BASE = (H * H + H) + 2 * (H * KV + KV) + H * H + 3 * H * INTER + 2 * H
ADAPTERS = 4 * (H + H) + 4 * (H + KV)  # r 4 on q_proj (64 -> 64) and v_proj (64 -> 32): A is r x in, B out x r
MIXING = 4 * BATCH * SEQ * SEQ * H * 0.5  # causal QK^T and AV
RATE = H200.bf16_tflops * 1e12 * ACHIEVED_FRACTION
WEIGHTS = BASE + ADAPTERS
FORWARD_FLOPS = 2 * WEIGHTS * TOKENS + MIXING
# input gradients through every weight (base and adapters), weight gradients of the adapters only, the mixing twice
BACKWARD_FLOPS = 2 * WEIGHTS * TOKENS + 2 * ADAPTERS * TOKENS + 2 * MIXING


def lora_meta(quantize: str = "none"):
    model = meta_model(tiny_config("qwen2"))
    add_adapters(model, LoraOptions(r=4, target_modules=["q_proj", "v_proj"], quantize=quantize))
    return adapter_for(model)


def test_a_frozen_layers_backward_is_its_input_gradients_and_its_adapters_weight_gradients():
    prof = analytic_profile(lora_meta(), BATCH, SEQ, H200)
    full = analytic_profile(meta(tiny_config("qwen2")), BATCH, SEQ, H200)
    assert prof.forward_seconds == pytest.approx([FORWARD_FLOPS / RATE] * 4, rel=1e-12)
    assert prof.head_seconds == pytest.approx(4 * VOCAB * H * TOKENS / RATE), "the frozen head: no weight gradient"
    # the working set holds the adapters' weight gradients, not the base's
    assert [w - f for w, f in zip(prof.working_bytes, full.working_bytes)] == [2 * ADAPTERS - 2 * BASE] * 4
    assert prof.backward_seconds == pytest.approx([BACKWARD_FLOPS / RATE] * 4, rel=1e-12)
    assert prof.backward_seconds[0] < 1.1 * prof.forward_seconds[0], "about one forward, not two"
    assert prof.grad_bytes == [2 * ADAPTERS] * 4 and prof.param_bytes == [2 * WEIGHTS] * 4
    # every weight trains: the backward is twice the forward, every weight's gradient goes back (as before)
    assert full.forward_seconds == pytest.approx([(2 * BASE * TOKENS + MIXING) / RATE] * 4, rel=1e-12)
    assert full.backward_seconds == pytest.approx([2 * f for f in full.forward_seconds], rel=1e-12)
    assert full.grad_bytes == full.param_bytes == [2 * BASE] * 4
    assert full.head_seconds == pytest.approx(6 * VOCAB * H * TOKENS / RATE)


def test_profile_model_and_the_meta_models_profile_count_a_lora_layer_alike(tmp_path):
    """The run's profile of a peft model (``profile_model``, analytic on the CPU) and ``lazytrain plan``'s of the
    meta model (a one-layer-per-kind copy of the base, frozen as the base is) agree on the backward's share of the
    forward, the gradient bytes and the working set; one cache holds both the LoRA and the full model's apart."""
    cache = str(tmp_path)
    real = profile_model(adapter_for(tiny_lora().get_base_model()), BATCH, SEQ, CPU, cache_dir=cache)
    full = profile_model(adapter_for(tiny_model("qwen2")), BATCH, SEQ, CPU, cache_dir=cache)
    assert real.forward_seconds == pytest.approx([FORWARD_FLOPS / ANALYTIC_FLOPS] * 4, rel=1e-12)
    assert real.backward_seconds == pytest.approx([BACKWARD_FLOPS / ANALYTIC_FLOPS] * 4, rel=1e-12)
    assert real.grad_bytes == [2 * ADAPTERS] * 4
    assert real.head_seconds == pytest.approx(4 * VOCAB * H * TOKENS / ANALYTIC_FLOPS)
    assert full.backward_seconds == pytest.approx([2 * f for f in full.forward_seconds], rel=1e-12)
    assert full.grad_bytes == [2 * BASE] * 4 and full.head_seconds == pytest.approx(1.5 * real.head_seconds)
    spread = measured_profile(lora_meta(), BATCH, SEQ, CPU, cache_dir=cache)
    ratio = BACKWARD_FLOPS / FORWARD_FLOPS
    assert spread.backward_seconds == pytest.approx([ratio * f for f in spread.forward_seconds], rel=1e-12)
    assert spread.grad_bytes == real.grad_bytes and spread.working_bytes == real.working_bytes
    assert spread.head_seconds == pytest.approx(real.head_seconds) and spread.param_bytes == real.param_bytes


def _profile(**kw) -> Profile:
    return Profile(
        forward_seconds=[0.1, 0.1],
        activation_bytes=[1, 1, 1],
        param_bytes=[10**9] * 2,
        head_seconds=0.05,
        h2d_bytes_per_s=20e9,
        d2h_bytes_per_s=10e9,
        duplex_bytes_per_s=40e9,
        nvme_read_bytes_per_s=1e9,
        nvme_write_bytes_per_s=1e9,
        device_name="x",
        sources=dict.fromkeys(SOURCE_KEYS, "analytic"),
        dtype="bfloat16",
        **kw,
    )


def test_the_problem_and_the_step_charge_a_frozen_layer_its_backward_and_its_adapters_gradients():
    huge = 1 << 40
    frozen = _profile(backward_seconds=[0.11, 0.11], grad_bytes=[10**6] * 2)
    problem = build_problem(frozen, huge, huge, huge)
    assert problem.window_seconds == pytest.approx([0.1 + 0.11 + 0.1] * 2)  # forward, backward, re-run
    assert problem.grad_d2h_bytes == [10**6] * 2 and problem.param_h2d_bytes == [2 * 10**9] * 2
    # per layer: re-run 0.1 + backward 0.11 against the weights' copy (0.05 s) and the adapters' gradients (0.1 ms)
    assert predict_step(frozen, Schedule.every(2), 0.0).backward_s == pytest.approx(2 * 0.21)
    trained = _profile()  # not profiled: every weight trains, twice the forward, the whole layer's gradient back
    assert build_problem(trained, huge, huge, huge).window_seconds == pytest.approx([0.4] * 2)
    assert predict_step(trained, Schedule.every(2), 0.0).backward_s == pytest.approx(2 * 0.3)
    assert build_problem(trained, huge, huge, huge).grad_d2h_bytes == [10**9] * 2


def test_a_qlora_profile_streams_the_packed_base_and_multiplies_by_the_unpacked_weights(tmp_path):
    run = RunSpec(lora_meta(), SEQ, precision="bf16-mixed", quantize="nf4")
    packed = run.counts.layer_stream_bytes  # the store's bytes to the byte (test_qlora_counting.py)
    assert max(packed) < WEIGHTS, "about half a byte per base weight"
    four_bit = profile_model(adapter_for(tiny_qlora().get_base_model()), BATCH, SEQ, CPU, cache_dir=str(tmp_path))
    assert four_bit.param_bytes == packed
    assert four_bit.forward_seconds == pytest.approx([FORWARD_FLOPS / ANALYTIC_FLOPS] * 4, rel=1e-12)
    assert four_bit.backward_seconds == pytest.approx([BACKWARD_FLOPS / ANALYTIC_FLOPS] * 4, rel=1e-12)
    assert four_bit.grad_bytes == [2 * ADAPTERS] * 4
    # lazytrain plan --gpu h200 on a machine without one: the analytic profile with the packed bytes
    spec, profile_for, _ = gpu_machine("h200", run)
    assert profile_for(BATCH).param_bytes == packed
    assert plan_inputs(run, Machine(spec, 1 << 40)).slot_bytes == run.slot_bytes == max(packed)


def test_a_lora_forecast_steps_with_input_gradients_only_and_counts_4n_model_flops():
    """Qwen2.5-7B with r 16 on every linear layer, bf16 base, batch 16 on an H200: each layer's backward is its
    FLOPs by hand, the step's backward their sum with the re-runs, and model FLOPs 4 per frozen parameter, 6 per
    adapter parameter, plus the attention's 12 L h s, per token."""
    model = meta_model(named("qwen2.5-7b"))
    add_adapters(model, LoraOptions(r=16))
    run = RunSpec(adapter_for(model), 1024, precision="bf16-mixed", schedule="milp")
    batch, h, layers, tokens = 16, 3584, 28, 16 * 1024
    base = (h * h + h) + 2 * (h * 512 + 512) + h * h + 3 * h * 18944 + 2 * h
    adapters = 16 * ((h + h) + 2 * (h + 512) + (h + h) + 2 * (h + 18944) + (18944 + h))
    mixing = 4 * batch * 1024 * 1024 * h * 0.5
    prof = analytic_profile(run.adapter, batch, 1024, H200)
    weights = base + adapters
    backward = (2 * weights * tokens + 2 * adapters * tokens + 2 * mixing) / RATE
    f = forecast(run, Machine(H200, 120 << 30, update_params_per_s=4e9), batch, lambda b: prof)
    kept = f.schedule.keep_graph
    reruns = sum(r for r, k in zip(prof.reruns, kept) if not k)
    mlp = sum(m for m, r in zip(prof.mlp_seconds, f.schedule.mlp_recompute) if r)
    assert f.prediction.backward_s == pytest.approx(layers * backward + reruns + mlp, rel=1e-9), "compute-bound"
    assert prof.backward_seconds == pytest.approx([backward] * layers, rel=1e-12)
    frozen, trained = run.counts.frozen_params, run.trainable_params
    assert trained == layers * adapters
    flops = (4 * frozen + 6 * trained + 12 * layers * h * 1024) * tokens
    assert f.model_tflops == pytest.approx(flops / f.prediction.step_s / 1e12, rel=1e-9)


@pytest.mark.gpu
def test_a_lora_models_measured_profile_holds_no_base_weight_gradients(tmp_path):
    """``lazytrain plan`` on a GPU: the one-layer-per-kind copy is frozen as the LoRA model's base is, so its
    measured working set loses the base's weight gradients (a bf16 layer's bytes) and its head computes none."""
    cuda, cache = torch.device("cuda"), str(tmp_path)
    full = measured_profile(meta(named("qwen2.5-3b")), 8, 1024, cuda, cache_dir=cache)
    model = meta_model(named("qwen2.5-3b"))
    add_adapters(model, LoraOptions(r=16))
    lora = measured_profile(adapter_for(model), 8, 1024, cuda, cache_dir=cache)
    assert lora.grad_bytes[0] < 0.05 * full.grad_bytes[0]
    assert lora.working_bytes[0] < full.working_bytes[0] - 0.5 * full.grad_bytes[0]
    assert lora.head_seconds < full.head_seconds
    assert lora.backward_seconds[0] < 1.2 * lora.forward_seconds[0] < 0.7 * full.backward_seconds[0]


def test_the_72b_qlora_plan_charges_input_gradients_and_says_its_flops(capsys, monkeypatch, tmp_path):
    """The recipe's plan for an H200: each layer's backward and re-run come to less than two forwards (a trained
    layer's would be about three), and the line says how model FLOPs count a frozen base."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    args = ["plan", "--config", "qwen2.5-72b-qlora", "--gpu", "h200", "--host_ram_gib", "128", "--max_batch", "false"]
    assert lazytrain([*args, "--update_gparams_per_s", "4"]) == 0
    out = capsys.readouterr().out
    forward, backward = (float(v) for v in re.search(r"forward ([\d.]+) \+ backward ([\d.]+)", out).groups())
    assert forward < backward < 2 * forward
    assert "model FLOPs 4 per frozen and 6 per trained parameter a token" in out
