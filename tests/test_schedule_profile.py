"""schedule/profile.py and schedule/build.py: Profile shapes, cache, disk probe, and the problem the solver gets."""

from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import replace

import pytest
import torch
from helpers import tiny_model

from lightning_lazytrain.models.adapter import adapter_for
from lightning_lazytrain.schedule import (
    Profile,
    build_problem,
    cache_key,
    cache_path,
    measure_disk,
    profile_model,
    solve,
)
from lightning_lazytrain.schedule import measure as measure_mod
from lightning_lazytrain.schedule import profile as profile_mod
from lightning_lazytrain.schedule.layer_memory import unique_numel
from lightning_lazytrain.schedule.timing import time_wall

CPU = torch.device("cpu")
BATCH, SEQ, HIDDEN, LAYERS = 2, 16, 64, 4


def _adapter(family: str):
    return adapter_for(tiny_model(family))


def _layer_numel(layer: torch.nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("family", ["qwen2", "qwen3.5"])
@pytest.mark.parametrize("dtype,itemsize", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_profile_lengths_and_bytes(tmp_path, family, dtype, itemsize):
    adapter = _adapter(family)
    prof = profile_model(adapter, BATCH, SEQ, CPU, dtype, cache_dir=str(tmp_path))
    assert prof.num_layers == LAYERS
    assert len(prof.forward_seconds) == LAYERS and len(prof.param_bytes) == LAYERS
    assert prof.activation_bytes == [BATCH * SEQ * HIDDEN * itemsize] * (LAYERS + 1)
    assert prof.param_bytes == [_layer_numel(layer) * itemsize for layer in adapter.layers]
    assert all(f > 0 for f in prof.forward_seconds) and prof.head_seconds > 0
    assert set(prof.sources.values()) == {"analytic"}  # no CUDA, no spill dir
    assert prof.layer_types == adapter.layer_types()
    assert (prof.batch, prof.seq) == (BATCH, SEQ)
    assert Profile.from_json(prof.to_json()) == prof
    if family == "qwen3.5":  # hybrid: linear and full attention layers get their own estimates
        assert set(prof.layer_types) == {"linear_attention", "full_attention"}
        by_type = {t: f for t, f in zip(prof.layer_types, prof.forward_seconds)}
        assert by_type["linear_attention"] != by_type["full_attention"]


def test_profile_json_rejects_bad_input():
    prof = profile_model(_adapter("qwen2"), BATCH, SEQ, CPU, torch.bfloat16, use_cache=False)
    d = json.loads(prof.to_json())
    with pytest.raises(ValueError):
        Profile.from_dict({**d, "version": 99})
    with pytest.raises(ValueError):
        Profile.from_dict({**d, "activation_bytes": d["activation_bytes"][:-1]})
    with pytest.raises(ValueError):
        Profile.from_dict({**d, "sources": {**d["sources"], "h2d": "guessed"}})


@pytest.mark.parametrize("family", ["qwen2", "qwen3.5"])
def test_measuring_code_runs_layers_and_head(family):
    """The CUDA path's layer/head calls (rotary, kwargs, one copy per layer kind), timed by wall clock on the CPU."""
    adapter = _adapter(family)
    calls = []

    def timer(fn, device):
        fn()
        calls.append(1)
        return 0.5

    per_layer = measure_mod.measure_layers(adapter, BATCH, SEQ, CPU, torch.float32, timer=timer)
    assert sorted(per_layer) == list(range(LAYERS))
    assert set(per_layer.values()) == {measure_mod.LayerMeasurement(0.5, 0.5, 0, 0, 0.5, 0)}
    # layer, layer without the MLP's output projection, and MLP once per distinct layer kind
    assert len(calls) == 3 * len(set(adapter.layer_types()))
    assert measure_mod.measure_head(adapter, 64, CPU, torch.float32, timer=timer) == pytest.approx(0.5)
    real = measure_mod.measure_layers(adapter, BATCH, SEQ, CPU, torch.float32, timer=time_wall)
    assert all(v.forward_seconds > v.mlp_seconds > 0 for v in real.values())
    assert all(0 < v.rerun_seconds <= v.forward_seconds for v in real.values())


def test_device_profile_measures_the_layers_once(monkeypatch):
    """The CUDA path of ``_measure`` (its device calls stubbed): one ``measure_layers`` call serves every layer."""
    adapter = _adapter("qwen2")
    calls = []

    def layers(adapter, batch, seq, device, dtype):
        calls.append(device)
        return {j: measure_mod.LayerMeasurement(0.4, 0.3, 1, 2, 0.2, 1) for j in range(LAYERS)}

    monkeypatch.setattr(profile_mod, "measure_layers_fitting",
                        functools.partial(measure_mod.measure_layers_fitting, measure=layers))
    monkeypatch.setattr(profile_mod, "measure_head", lambda *args: 0.5)
    monkeypatch.setattr(profile_mod, "measure_link_cuda", lambda device: (1e9, 1e9, 2e9))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "stub")
    prof = profile_mod._measure(adapter, BATCH, SEQ, torch.device("cuda", 0), torch.bfloat16, None)
    assert len(calls) == 1
    assert prof.forward_seconds == [0.4] * LAYERS and prof.rerun_seconds == [0.3] * LAYERS
    assert prof.mlp_seconds == [0.2] * LAYERS and prof.working_bytes == [2] * LAYERS


def test_a_layer_that_does_not_fit_whole_batch_is_profiled_on_fewer_rows_and_scaled(monkeypatch):
    """The batches layer micro-batches exist for: one whole-batch layer runs out of device memory while profiling
    (the 7B shape at batch 192 under a 24 GiB cap, `suite_auto_3a1dda2_h100.json`). It is measured at half the
    rows, then half again, and scaled: times, graphs and the per-token working set by 8 / 2, the weight
    gradients (the parameter bytes) once."""
    adapter, tried = _adapter("qwen2"), []
    params = [unique_numel(layer) * 2 for layer in adapter.layers]

    def layers(adapter, batch, seq, device, dtype):
        tried.append(batch)
        if batch > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.94 GiB")
        return {j: measure_mod.LayerMeasurement(0.4, 0.3, 1000, params[j] + 500, 0.2, 100) for j in range(LAYERS)}

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    measured, rows = measure_mod.measure_layers_fitting(adapter, 8, SEQ, torch.device("cuda", 0), torch.bfloat16,
                                                        measure=layers)
    assert tried == [8, 4, 2] and rows == 2
    m = measured[0]
    assert (m.forward_seconds, m.rerun_seconds, m.mlp_seconds) == pytest.approx((1.6, 1.2, 0.8))
    assert (m.graph_bytes, m.mlp_graph_bytes, m.working_bytes) == (4000, 400, params[0] + 2000)
    with pytest.raises(torch.OutOfMemoryError):  # not even one row fits: the error stands
        measure_mod.measure_layers_fitting(adapter, 1, SEQ, torch.device("cuda", 0), torch.bfloat16,
                                           measure=lambda *a: layers(adapter, 3, SEQ, None, None))
    # a frozen layer keeps no weight gradients: its whole working set grows with the rows
    adapter.layers[0].requires_grad_(False)
    measured, _ = measure_mod.measure_layers_fitting(adapter, 8, SEQ, torch.device("cuda", 0), torch.bfloat16,
                                                     measure=layers)
    assert measured[0].working_bytes == (params[0] + 500) * 4 and measured[1].working_bytes == params[1] + 2000


def test_cache_hit_on_second_call(tmp_path, monkeypatch):
    adapter = _adapter("qwen2")
    first = profile_model(adapter, BATCH, SEQ, CPU, torch.bfloat16, cache_dir=str(tmp_path))
    path = cache_path(cache_key(adapter, BATCH, SEQ, CPU, torch.bfloat16), str(tmp_path))
    assert path.exists() and list(tmp_path.iterdir()) == [path]

    def fail(*args, **kwargs):
        raise AssertionError("re-measured although a cached profile exists")

    monkeypatch.setattr(profile_mod, "_measure", fail)
    second = profile_model(adapter, BATCH, SEQ, CPU, torch.bfloat16, cache_dir=str(tmp_path))
    assert second == first
    with pytest.raises(AssertionError, match="re-measured"):  # another batch is another key
        profile_model(adapter, BATCH * 2, SEQ, CPU, torch.bfloat16, cache_dir=str(tmp_path))


def test_corrupt_cache_is_rewritten(tmp_path, monkeypatch):
    adapter = _adapter("qwen2")
    path = cache_path(cache_key(adapter, BATCH, SEQ, CPU, torch.bfloat16), str(tmp_path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    real, calls = profile_mod._measure, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(profile_mod, "_measure", counting)
    prof = profile_model(adapter, BATCH, SEQ, CPU, torch.bfloat16, cache_dir=str(tmp_path))
    assert len(calls) == 1
    stored = json.loads(path.read_text())
    assert Profile.from_dict(stored["profile"]) == prof
    # a parseable file with a wrong shape is also ignored and rewritten
    path.write_text(json.dumps({"key": stored["key"], "profile": {"forward_seconds": [1.0]}}))
    assert profile_model(adapter, BATCH, SEQ, CPU, torch.bfloat16, cache_dir=str(tmp_path)) == prof
    assert len(calls) == 2 and Profile.from_dict(json.loads(path.read_text())["profile"]) == prof


def test_nvme_probe_leaves_no_file(tmp_path):
    spill = tmp_path / "spill"
    read, write = measure_disk(str(spill), 1 << 20)
    assert read > 0 and write > 0 and os.listdir(spill) == []
    prof = profile_model(_adapter("qwen2"), BATCH, SEQ, CPU, torch.bfloat16, spill_dir=str(spill),
                         cache_dir=str(tmp_path / "cache"))
    assert prof.sources["nvme_read"] == prof.sources["nvme_write"] == "measured"
    assert prof.nvme_read_bytes_per_s != profile_mod.DISK_READ and prof.nvme_write_bytes_per_s != profile_mod.DISK_WRITE
    assert prof.sources["h2d"] == "analytic"
    assert os.listdir(spill) == []


def test_build_problem_and_solve(tmp_path):
    prof = profile_model(_adapter("qwen3.5"), BATCH, SEQ, CPU, torch.bfloat16, cache_dir=str(tmp_path))
    huge = 1 << 40
    problem = build_problem(prof, huge, huge, huge)
    assert problem.num_layers == LAYERS and problem.max_recompute_span == 4
    assert problem.activation_bytes == prof.activation_bytes
    assert problem.forward_seconds == prof.forward_seconds
    # the re-run skips the MLP's output projection (hidden x intermediate weights, 2 FLOPs each per token)
    skipped = 2.0 * HIDDEN * 128 * BATCH * SEQ / profile_mod.ANALYTIC_FLOPS
    assert problem.rerun_seconds == prof.rerun_seconds == pytest.approx([f - skipped for f in prof.forward_seconds])
    # fwd + 2 fwd of backward + the re-run
    windows = [3.0 * f + r for f, r in zip(prof.forward_seconds, prof.rerun_seconds, strict=True)]
    assert problem.window_seconds == pytest.approx(windows)
    assert problem.param_h2d_bytes == [2 * b for b in prof.param_bytes]
    assert problem.grad_d2h_bytes == prof.param_bytes
    assert problem.head_seconds == prof.head_seconds
    assert problem.h2d_bytes_per_s == pytest.approx(min(prof.h2d_bytes_per_s, prof.duplex_bytes_per_s / 2))
    sched = solve(problem, time_limit=10)
    assert sched.homes == ["gpu"] * (LAYERS + 1)
    assert sched.recomputed_layers() == 0
    # only the two ends fit anywhere: the plan must recompute, proving the budgets reach the solver
    ends = prof.activation_bytes[0] + prof.activation_bytes[-1]
    tight = solve(build_problem(prof, ends, 0, 0, max_recompute_span=LAYERS), time_limit=10)
    assert tight.homes == ["gpu"] + ["recompute"] * (LAYERS - 1) + ["gpu"]
    # a backward of one forward (a frozen layer's input gradients alone), the graph kept: no re-run in the window
    kept = build_problem(replace(prof, backward_seconds=prof.forward_seconds), huge, huge, huge, reforward=False)
    assert kept.window_seconds == pytest.approx([2.0 * f for f in prof.forward_seconds])
    assert kept.param_h2d_bytes == prof.param_bytes


@pytest.mark.gpu
def test_profile_on_cuda(tmp_path):
    adapter = _adapter("qwen3.5")
    prof = profile_model(adapter, BATCH, SEQ, torch.device("cuda"), torch.bfloat16, spill_dir=str(tmp_path / "s"),
                         cache_dir=str(tmp_path / "c"))
    assert set(prof.sources.values()) == {"measured"}
    assert all(f > 0 for f in prof.forward_seconds) and prof.head_seconds > 0
    assert prof.h2d_bytes_per_s > 1e9 and prof.duplex_bytes_per_s > 1e9
    # the backward starts with the whole graph (its output included) and the output's gradient alive, and ends
    # with every weight gradient and the input gradient; autograd frees saved tensors as it goes, so the peak
    # need not hold the graph and the weight gradients at once
    act = prof.activation_bytes[0]
    assert all(g > act for g in prof.graph_bytes)
    for w, g, p in zip(prof.working_bytes, prof.graph_bytes, prof.param_bytes):
        assert w >= max(g + act, p + act), (w, g, p, act)
    assert os.listdir(tmp_path / "s") == []


def test_the_measured_layer_copies_are_gone_when_measuring_returns(monkeypatch):
    """A fused submodule holds a bound ``forward`` of itself (a reference cycle), so the MLP and attention of the
    profile's device copy outlived it until some garbage collection: 0.5 GiB of an H100's 24 GiB cap at 7B, still
    allocated at the second step (plan_memory_7b_24g_b32_live_2ca99fd_h100.json)."""
    import gc
    import weakref

    from lightning_lazytrain.models.fused_kernels import fuse_decoder_kernels

    adapter = _adapter("qwen2")
    assert fuse_decoder_kernels(adapter.layers) > 0  # bound, never called: the timer below runs nothing
    copies, deepcopy = [], copy.deepcopy
    def recorded(obj, memo=None):
        made = deepcopy(obj, memo)
        if memo is None and isinstance(made, torch.nn.Module):  # the profile's own copies, not calls inside one
            copies.extend(weakref.ref(m) for m in made.modules())  # a fused submodule is its own cycle
        return made

    monkeypatch.setattr(copy, "deepcopy", recorded)
    gc.disable()
    try:
        measure_mod.measure_layers(adapter, BATCH, SEQ, CPU, torch.float32, timer=lambda fn, device: 0.5)
        alive = [ref() for ref in copies if ref() is not None]
    finally:
        gc.enable()
    assert copies and not alive, alive
