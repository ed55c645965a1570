"""lazytrain over 2 processes (CPU, gloo) against one process that sees the same global batch.

How the processes start: ``tests/dist_driver.py`` is run once as a script. With no ``LOCAL_RANK`` in its
environment, Lightning's own subprocess launcher (the one ``devices=N`` uses for every user script) re-runs it
for local rank 1, so this is the path users get. The two-machine run starts both processes itself with
``LOCAL_RANK=0`` and ``NODE_RANK=0/1``, as a cluster scheduler would: each "machine" then has its own shared
streamed copy, and the all-gather of updated shards across machines runs on one host.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from dist_driver import HybridModule
from dist_launch import BF16_MIXED_ARGS, launch, launch_two_machines
from helpers import batches, loader, rel_diff, tiny_model, train, update_rel_diff
from transformers import AutoModelForCausalLM

from lightning_lazytrain.admission import admission_report
from lightning_lazytrain.checkpoint.sharded import consolidate, export_sharded_hf

CLIP = 0.05
STEPS = 3


def _weights(run: Path, start: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(start)
    model.load_state_dict(torch.load(run / "weights.pt"))
    return model


def _info(run: Path, rank: int) -> dict:
    return json.loads((run / f"rank_{rank}.json").read_text())


def _global_batches() -> list[dict]:
    """What one process sees per step: rank 0's and rank 1's batches of the driver side by side."""
    b = batches(4)
    return [{k: torch.cat([b[i][k], b[i + 1][k]]) for k in b[i]} for i in (0, 2)]


@pytest.fixture(scope="module")
def start() -> torch.nn.Module:
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def reference(start):
    """Plain Lightning, torch AdamW, one process, global batch 4, clipped at CLIP."""
    ref, _ = train(start, _global_batches(), max_steps=STEPS, gradient_clip_val=CLIP)
    return ref


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_procs")
    return launch(out, "--clip", str(CLIP), "--steps", str(STEPS), "--ckpt-dir", str(out / "ckpt"))


def test_two_processes_match_one_process(start, reference, two_procs):
    one = HybridModule(copy.deepcopy(start))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", max_steps=STEPS, gradient_clip_val=CLIP,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(one, loader(_global_batches()))
    unclipped, _ = train(start, _global_batches(), max_steps=STEPS)
    got = _weights(two_procs, start)
    assert rel_diff(unclipped.model, reference.model) > 1e-4, "clipping must change this run"
    assert rel_diff(reference.model, start) > 1e-2, "the reference run must have moved the weights"
    assert rel_diff(got, reference.model) <= 1e-5
    assert update_rel_diff(start, got, reference.model) <= 1e-4
    # the same engine in one process: only the order of the gradient sums differs
    assert rel_diff(got, one.model) <= 2e-6
    mean_losses = [(a + b) / 2 for a, b in zip(_info(two_procs, 0)["losses"], _info(two_procs, 1)["losses"])]
    assert mean_losses == pytest.approx(reference.losses, rel=1e-6)


def test_two_machines_match_two_processes_on_one(start, reference, two_procs, tmp_path):
    run = launch_two_machines(tmp_path, "--clip", str(CLIP), "--steps", str(STEPS))
    got = _weights(run, start)
    assert rel_diff(got, reference.model) <= 1e-5
    assert rel_diff(got, _weights(two_procs, start)) == 0.0
    infos = [_info(run, r) for r in (0, 1)]
    assert infos[0]["shm_path"] != infos[1]["shm_path"], "each machine holds its own streamed copy"
    params = sum(p.numel() for p in start.parameters())
    for info in infos:
        assert info["local_world"] == 1 and info["optimizer_threads"] >= 1
        # this CPU run's own device copies (slots, resident parts) and step workspace, per process
        assert info["host_pieces"].pop("CPU run: device copies") > 0
        assert info["host_pieces"].pop("CPU run: step workspace") > 0
        assert info["host_pieces"] == {"streamed copy (shared, once per host)": 4 * params,
                                       "gradient shards": 4 * params // 2, "optimizer state shards": 8 * params // 2}


def test_streamed_copy_is_one_shared_mapping_per_host(start, two_procs):
    infos = [_info(two_procs, r) for r in (0, 1)]
    params = sum(p.numel() for p in start.parameters())
    assert infos[0]["shm_path"] == infos[1]["shm_path"]
    assert infos[0]["shm_inode"] == infos[1]["shm_inode"]
    for info in infos:
        assert [perms[3] for perms, _ in info["maps"]] == ["s"], "one MAP_SHARED mapping of the file"
        assert info["maps"][0][1] == str(info["shm_inode"])
        assert info["params_view_shared"] and info["masters_view_shared"]
        # 32-true: the shared copy is the fp32 weights, padded per unit to 2 equal shards and 256-element starts
        assert 4 * params <= info["shm_bytes"] <= 4 * (params + 5 * 256)
        assert info["shard_numel"] == info["grad_shard_numel"]
    assert sum(i["shard_numel"] for i in infos) >= params
    assert max(i["shard_numel"] for i in infos) - params / 2 <= 5  # 5 units, at most 1 element of padding each
    one_process = admission_report(num_params=params, precision="32-true", host_have_bytes=0, gpu_have_bytes=0,
                                   optimizer_state_bytes_per_param=8.0).tiers["host"].need
    pieces = infos[0]["host_pieces"]
    assert pieces["streamed copy (shared, once per host)"] == 4 * params
    # the CPU run's per-process device copies (slots, resident parts) and step workspace
    assert pieces.pop("CPU run: device copies") > 0 and pieces.pop("CPU run: step workspace") > 0
    assert sum(pieces.values()) == one_process, "two processes on one host need what one process needs, not twice"


def test_resume_from_sharded_checkpoint_equals_unbroken_run(start, two_procs, tmp_path):
    ckpt = two_procs / "ckpt" / "epoch=0-step=2.ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.pt", "rank_0.pt", "rank_1.pt"]
    run = launch(tmp_path, "--clip", str(CLIP), "--steps", str(STEPS), "--resume", str(ckpt))
    resumed, straight = _weights(run, start), _weights(two_procs, start)
    assert rel_diff(resumed, start) > 1e-2
    assert rel_diff(resumed, straight) == 0.0
    for rank in (0, 1):
        assert _info(run, rank)["losses"] == _info(two_procs, rank)["losses"][2:]


def test_sharded_checkpoint_refuses_another_world_size(start, two_procs):
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="saved by 2 processes"):
        trainer.fit(HybridModule(copy.deepcopy(start)), loader(_global_batches()),
                    ckpt_path=two_procs / "ckpt" / "epoch=0-step=2.ckpt")


def test_consolidated_export_is_the_trained_model(start, two_procs, tmp_path):
    out = export_sharded_hf(two_procs / "ckpt" / "epoch=1-step=3.ckpt", copy.deepcopy(start), tmp_path / "hf",
                            dtype=None)
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert rel_diff(exported, start) > 1e-2
    assert rel_diff(exported, _weights(two_procs, start)) == 0.0


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_admission_counts_the_shared_copy_once_and_a_share_of_the_rest(precision):
    kw = dict(num_params=1000, precision=precision, host_have_bytes=0, gpu_have_bytes=0,
              optimizer_state_bytes_per_param=8.0)
    one = admission_report(**kw).tiers["host"]
    same_host = admission_report(**kw, ranks_per_host=4, world_size=4).tiers["host"]
    half_host = admission_report(**kw, ranks_per_host=2, world_size=4).tiers["host"]
    assert same_host.need == one.need
    streamed = 4000 if precision == "32-true" else 2000
    assert half_host.pieces["streamed copy (shared, once per host)"] == streamed
    assert half_host.need - streamed == (one.need - streamed) // 2
    assert ("master weight shards" in half_host.pieces) == (precision == "bf16-mixed")


def test_bf16_mixed_two_processes_within_bf16_noise(start, reference, bf16_mixed_two_procs):
    """bf16-mixed: fp32 master shards of their own, the bf16 copy shared and written by the update kernel.

    Two processes cannot agree with one to fp32 rounding here (the reduce-scatter sums bf16 gradients), so the
    tolerance is the bf16 noise floor: how far a one-process bf16-mixed run is from the fp32 reference."""
    run = bf16_mixed_two_procs
    assert BF16_MIXED_ARGS[:4] == ("--clip", str(CLIP), "--steps", str(STEPS)), "the one-process run's settings"
    one = HybridModule(copy.deepcopy(start))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", precision="bf16-mixed", max_steps=STEPS,
                         gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(one, loader(_global_batches()))
    # the fp32 masters (the module's parameters are the bf16 copy, whose rounding alone is ~ the noise floor)
    masters = consolidate(run / "ckpt" / f"epoch=1-step={STEPS}.ckpt")
    got = copy.deepcopy(start)
    got.load_state_dict(masters)
    streamed = _weights(run, start)
    assert all(masters[k].dtype == torch.float32 for k in masters)
    assert all(torch.equal(masters[k].bfloat16(), v.bfloat16()) for k, v in streamed.state_dict().items())
    noise = update_rel_diff(start, one.model, reference.model)
    assert 0 < noise < 0.5
    assert update_rel_diff(start, got, one.model) <= noise
    info = _info(run, 0)
    assert info["params_view_shared"] and not info["masters_view_shared"]
    params = sum(p.numel() for p in start.parameters())
    assert info["host_pieces"]["streamed copy (shared, once per host)"] == 2 * params
    assert info["host_pieces"]["master weight shards"] == 4 * params
