import mmap
from types import SimpleNamespace

import pytest
import torch

from lightning_lazytrain.sft.metrics import (
    ThroughputMetrics,
    host_rss_bytes,
    model_flops_per_token,
    model_flops_utilization,
)
from lightning_lazytrain.sft.module import build_model

TINY = dict(model_type="qwen2", vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def _setup(strategy, device="cpu", **metrics_kw):
    model = build_model(model_config=TINY)
    module = SimpleNamespace(model=model, device=torch.device(device))
    cb = ThroughputMetrics(**metrics_kw)
    trainer = SimpleNamespace(strategy=strategy)
    cb.on_fit_start(trainer, module)
    return cb, trainer, module, sum(p.numel() for p in model.parameters())


def test_step_metrics_formula_and_engine_stats():
    strategy = SimpleNamespace(executed_flops_factor=1.5,
                               last_step_stats={"stall_s": 0.25, "plan": "x", "layers": 3, "ok": True})
    cb, trainer, module, n = _setup(strategy)
    batch = {"input_ids": torch.zeros(4, 32, dtype=torch.long),
             "attention_mask": torch.cat([torch.ones(4, 24), torch.zeros(4, 8)], 1).long()}
    m = cb.step_metrics(trainer, module, batch, step_s=0.5)
    assert m["perf/tokens_per_s"] == pytest.approx(4 * 24 / 0.5)
    expected = (6 * n + 12 * 3 * 16 * 32) * 4 * 32 / 0.5 / 1e12
    assert m["perf/model_tflops"] == pytest.approx(expected)
    assert m["perf/executed_tflops"] == pytest.approx(1.5 * expected)
    assert m["engine/stall_s"] == 0.25 and m["engine/layers"] == 3.0
    assert "engine/plan" not in m and "engine/ok" not in m
    assert 0 < m["mem/host_rss_gib"] < 1024


def test_executed_equals_model_without_factor():
    cb, trainer, module, _ = _setup(SimpleNamespace())
    m = cb.step_metrics(trainer, module, {"input_ids": torch.zeros(2, 8, dtype=torch.long)}, step_s=1.0)
    assert m["perf/executed_tflops"] == m["perf/model_tflops"] > 0
    assert not any(k.startswith("engine/") for k in m)


def test_helpers():
    assert model_flops_per_token(10, 2, 4, 8) == 6 * 10 + 12 * 2 * 4 * 8
    before = host_rss_bytes()
    # a fresh anonymous mapping, so no allocator can hand back pages that are already resident
    block = mmap.mmap(-1, 64 * 2**20)
    block.write(b"\1" * (64 * 2**20))
    assert host_rss_bytes() > before + 32 * 2**20
    block.close()


def test_mfu_is_model_tflops_over_the_gpus_bf16_peak(monkeypatch):
    assert model_flops_utilization(494.5, 989.0) == 0.5  # half an H200's dense bf16 peak
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cb, trainer, module, n = _setup(SimpleNamespace(), device="cuda:0")
    batch = {"input_ids": torch.zeros(4, 32, dtype=torch.long)}
    m = cb.step_metrics(trainer, module, batch, step_s=0.5)
    tflops = (6 * n + 12 * 3 * 16 * 32) * 4 * 32 / 0.5 / 1e12
    assert m["perf/model_tflops"] == pytest.approx(tflops)
    assert m["perf/mfu"] == pytest.approx(tflops / 989.0)
    a100, *_ = _setup(SimpleNamespace(), device="cuda:0", peak_tflops=312.0)  # a given peak wins over the table
    assert a100.step_metrics(trainer, module, batch, step_s=0.5)["perf/mfu"] == pytest.approx(tflops / 312.0)


def test_no_mfu_on_the_cpu_or_an_unknown_gpu(monkeypatch):
    cpu, trainer, module, _ = _setup(SimpleNamespace())
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    assert "perf/mfu" not in cpu.step_metrics(trainer, module, batch, step_s=1.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    unknown, trainer, module, _ = _setup(SimpleNamespace(), device="cuda:0")
    assert "perf/mfu" not in unknown.step_metrics(trainer, module, batch, step_s=1.0)


def test_throughput_and_mfu_go_to_the_progress_bar():
    logged = []
    module = SimpleNamespace(model=build_model(model_config=TINY), device=torch.device("cpu"),
                             log_dict=lambda metrics, **kw: logged.append((set(metrics), kw.get("prog_bar", False))))
    cb = ThroughputMetrics(peak_tflops=100.0)
    trainer = SimpleNamespace(strategy=SimpleNamespace())
    cb.on_fit_start(trainer, module)
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    cb.on_train_batch_start(trainer, module, batch, 0)
    cb.on_train_batch_end(trainer, module, None, batch, 0)
    shown = set().union(*(keys for keys, bar in logged if bar))
    assert shown == {"perf/tokens_per_s", "perf/model_tflops", "perf/mfu"}
    assert "perf/step_s" in set().union(*(keys for keys, bar in logged if not bar))


def test_a_lora_model_counts_its_frozen_base_4_flops_a_parameter_and_4bit_weights_by_their_elements():
    peft = pytest.importorskip("peft")
    model = build_model(model_config=TINY)
    full = sum(p.numel() for p in model.parameters())
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layer = model.base_model.model.model.layers[0].mlp
    from lightning_lazytrain.models.quantize import quantized_linear

    layer.up_proj = quantized_linear(layer.up_proj, "nf4", torch.float32)  # packed: 2 elements a byte
    assert sum(p.numel() for p in model.parameters()) < full + adapters
    cb, trainer = ThroughputMetrics(), SimpleNamespace(strategy=SimpleNamespace())
    cb.on_fit_start(trainer, SimpleNamespace(model=model, device=torch.device("cpu")))
    m = cb.step_metrics(trainer, None,
                        {"input_ids": torch.zeros(2, 8, dtype=torch.long)}, step_s=1.0)
    expected = (4 * full + 6 * adapters + 12 * 3 * 16 * 8) * 2 * 8 / 1e12
    assert m["perf/model_tflops"] == pytest.approx(expected)
