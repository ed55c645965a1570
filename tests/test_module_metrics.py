import mmap
from types import SimpleNamespace

import pytest
import torch

from lightning_lazytrain.sft.metrics import ThroughputMetrics, host_rss_bytes, model_flops_per_token
from lightning_lazytrain.sft.module import build_model

TINY = dict(model_type="qwen2", vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def _setup(strategy):
    model = build_model(model_config=TINY)
    module = SimpleNamespace(model=model, device=torch.device("cpu"))
    cb = ThroughputMetrics()
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
