"""One load of the weights per machine (CPU, gloo, 2 processes on one "machine"): a module that builds its model in
``configure_model`` gets it on the meta device on local rank 1, which then maps local rank 0's shared copy.

The model is the tiny qwen2 with a 300k vocabulary: ~154 MB of fp32 weights, almost all in the embedding and the
head, so a second copy in rank 1 would show in its memory far above the noise of starting a Lightning process.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from dist_driver import HybridModule
from dist_launch import BF16_MIXED_ARGS, launch
from helpers import batches, loader, rel_diff, tiny_model, update_rel_diff

from lightning_lazytrain.checkpoint.sharded import consolidate

VOCAB = 300_000
STEPS = 2


@pytest.fixture(scope="module")
def start() -> torch.nn.Module:
    return tiny_model("qwen2", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("node_load")
    return launch(out, "--steps", str(STEPS), "--configure-model-vocab", str(VOCAB))


def _info(run: Path, rank: int) -> dict:
    return json.loads((run / f"rank_{rank}.json").read_text())


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_only_local_rank_0_holds_a_copy_while_loading(start, run):
    infos = [_info(run, r) for r in (0, 1)]
    size = _model_bytes(start)
    assert size > 150e6
    assert infos[0]["built_on"] == ["cpu"] and infos[1]["built_on"] == ["meta"]
    # from the driver's start to its store being built: rank 0 held the model once, rank 1 never held it
    assert infos[0]["peak_anon_growth"] >= 0.9 * size
    assert infos[1]["peak_anon_growth"] <= 0.2 * size
    for info in infos:
        assert info["params_view_shared"] and info["masters_view_shared"]
        assert 4 * sum(p.numel() for p in start.parameters()) <= info["shm_bytes"]


def test_weights_equal_one_process_on_the_same_global_batch(start, run):
    one = HybridModule(copy.deepcopy(start))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    b = batches(4)
    trainer.fit(one, loader([{k: torch.cat([b[i][k], b[i + 1][k]]) for k in b[i]} for i in (0, 2)]))
    got = copy.deepcopy(start)
    got.load_state_dict(torch.load(run / "weights.pt"))
    assert rel_diff(one.model.model.layers, start.model.layers) > 1e-2, "the run must have moved the weights"
    assert update_rel_diff(start, got, one.model) <= 1e-5
    assert rel_diff(got, one.model) <= 2e-6
    mean_losses = [(a + b) / 2 for a, b in zip(_info(run, 0)["losses"], _info(run, 1)["losses"])]
    assert mean_losses == pytest.approx(one.losses, rel=1e-6)


def test_buffers_are_local_rank_0s_on_every_rank(start, run):
    expected = dict(start.named_buffers())
    assert "model.rotary_emb.inv_freq" in expected
    for rank in (0, 1):
        got = torch.load(run / f"buffers_{rank}.pt")
        assert sorted(got) == sorted(expected)
        for name, buf in expected.items():
            assert got[name].device.type == "cpu" and torch.equal(got[name], buf), (rank, name)


def test_bf16_mixed_master_shards_come_from_local_rank_0s_fp32_weights(tmp_path, bf16_mixed_two_procs):
    """bf16-mixed: rank 1's fp32 master shard cannot come from the bf16 shared copy; it must equal the one a rank
    that built its own fp32 model slices (the masters after 3 steps are bitwise those of the __init__ path, the
    run of ``bf16_mixed_two_procs``)."""
    run = launch(tmp_path, *BF16_MIXED_ARGS, "--ckpt-dir", str(tmp_path / "ckpt"), "--configure-model-vocab", "512")
    assert _info(run, 1)["built_on"] == ["meta"]
    init, configured = (consolidate(r / "ckpt" / "epoch=1-step=3.ckpt") for r in (bf16_mixed_two_procs, run))
    start = tiny_model("qwen2").state_dict()
    assert all(init[k].dtype == torch.float32 for k in init)
    assert any(not torch.equal(init[k], start[k]) for k in init), "the run must have moved the masters"
    assert all(torch.equal(configured[k], init[k]) for k in init)


def test_the_recipe_module_builds_on_meta_on_local_rank_1(tmp_path):
    """CausalLMModule builds in configure_model: nothing before it (its setup hook, Lightning's) touches the model."""
    run = launch(tmp_path, "--steps", "1", "--configure-model-vocab", "151669", "--sft")
    infos = [_info(run, r) for r in (0, 1)]
    assert infos[0]["built_on"] == ["cpu"] and infos[1]["built_on"] == ["meta"]
    assert all(info["params_view_shared"] for info in infos)
    buffers = [torch.load(run / f"buffers_{r}.pt") for r in (0, 1)]
    assert "model.rotary_emb.inv_freq" in buffers[0]
    assert all(torch.equal(buffers[1][k], v) for k, v in buffers[0].items())
