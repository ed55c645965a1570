import json

import pytest

from lightning_lazytrain.engine import Schedule
from lightning_lazytrain.schedule import ScheduleProblem


def test_interval_schedule_is_megatrain_policy():
    s = Schedule.every(10, 4)
    assert s.num_layers == 10 and len(s.homes) == 11
    assert s.materialized() == [0, 4, 8, 10]
    assert s.blocks() == [(0, 4), (4, 8), (8, 10)]
    assert all(s.homes[i] == "recompute" for i in (1, 2, 3, 5, 6, 7, 9))
    assert s.recomputed_layers() == 3 + 3 + 1
    assert Schedule.every(8, 4).materialized() == [0, 4, 8]
    assert s.status == "interval:4" and s.max_recompute_span == 4


def test_interval_one_keeps_every_boundary_on_the_gpu():
    s = Schedule.every(5)
    assert s.homes == ["gpu"] * 6 and s.blocks() == [(i, i + 1) for i in range(5)] and s.recomputed_layers() == 0
    assert s.keep_graph == [False] * 5


def test_kept_graphs_save_both_their_boundaries_on_the_gpu():
    s = Schedule.every(6, 3, keep_graph_layers=2)
    assert s.homes == ["gpu", "recompute", "recompute", "gpu", "gpu", "gpu", "gpu"]
    assert s.keep_graph == [False] * 4 + [True] * 2 and s.graph_layers == 2
    assert s.slots_needed(2) == 2 + 3 + 2  # two held graphs, the block (0, 3), two slots of prefetch


def test_json_round_trip_with_keep_graph():
    s = Schedule(homes=["gpu", "cpu", "recompute", "nvme", "gpu"], objective=0.25, predicted_exposed_seconds=0.2,
                 status="optimal", keep_graph=[True, False, False, True], max_recompute_span=2,
                 info={"mip_gap": 0.0})
    t = Schedule.from_json(s.to_json())
    assert t == s
    assert json.loads(s.to_json())["homes"] == s.homes and json.loads(s.to_json())["version"] == 2
    assert Schedule.from_json(Schedule.every(6, 3).to_json()) == Schedule.every(6, 3)


@pytest.mark.parametrize(
    "homes,kwargs,match",
    [(["cpu", "gpu"], {}, "must be 'gpu'"), (["gpu", "recompute"], {}, "must be 'gpu'"),
     (["gpu", "disk", "gpu"], {}, "unknown home"), (["gpu"], {}, "L\\+1 >= 2"),
     (["gpu", "recompute", "recompute", "gpu"], {"max_recompute_span": 2}, "exceed max_recompute_span"),
     (["gpu", "gpu", "gpu"], {"keep_graph": [False]}, "keep_graph must have"),
     (["gpu", "recompute", "gpu"], {"keep_graph": [True, False]}, "single-layer blocks")],
)
def test_schedule_validation(homes, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(homes=homes, **kwargs)


def test_from_json_rejects_bad_documents():
    with pytest.raises(ValueError, match="homes"):
        Schedule.from_json("[1, 2]")
    with pytest.raises(ValueError, match="'homes' list"):
        Schedule.from_json(json.dumps({"tiers": ["gpu", "gpu"], "version": 2}))
    with pytest.raises(ValueError, match="unknown keys"):
        Schedule.from_json(json.dumps({"tiers": ["gpu", "gpu"], "bogus": 1}))
    with pytest.raises(ValueError, match="version"):
        Schedule.from_json(json.dumps({"tiers": ["gpu", "gpu"], "version": 99}))
    with pytest.raises(ValueError, match="must be 'gpu'"):
        Schedule.from_json(json.dumps({"tiers": ["gpu", "nvme"]}))


def test_version_1_plans_with_tiers_still_load():
    homes = ["gpu", "recompute", "nvme", "gpu"]
    assert Schedule.from_json(json.dumps({"version": 1, "tiers": homes})) == Schedule(homes)
    assert Schedule.from_json(json.dumps({"tiers": homes, "keep_graph": [False] * 3})) == Schedule(homes)


def test_plans_written_with_the_solvers_transfers_still_load():
    old = {"tiers": ["gpu", "cpu", "gpu"], "transfers": [{"boundary": 1, "window": 1, "direction": "offload",
                                                          "tier": "cpu", "bytes": 123.0}]}
    assert Schedule.from_json(json.dumps(old)) == Schedule(homes=["gpu", "cpu", "gpu"])


def _kw(n=3, **over):
    kw = dict(activation_bytes=[10] * (n + 1), forward_seconds=[0.1] * n, window_seconds=[0.3] * n,
              param_h2d_bytes=[1] * n, grad_d2h_bytes=[1] * n, gpu_budget_bytes=100, cpu_budget_bytes=0,
              nvme_budget_bytes=0, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, nvme_read_bytes_per_s=1e8,
              nvme_write_bytes_per_s=1e8, max_recompute_span=2)
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over,match",
    [({"forward_seconds": [0.1] * 2}, "forward_seconds must have 3"),
     ({"activation_bytes": [10, -1, 10, 10]}, "activation_bytes\\[1\\] must be finite and >= 0"),
     ({"activation_bytes": [10, 1.5, 10, 10]}, "whole number"),
     ({"grad_d2h_bytes": [1, 1]}, "grad_d2h_bytes must have 3"),
     ({"gpu_budget_bytes": -5}, "gpu_budget_bytes must be >= 0"),
     ({"h2d_bytes_per_s": 0}, "h2d_bytes_per_s must be > 0"),
     ({"max_recompute_span": 0}, "max_recompute_span"),
     ({"window_seconds": [0.1, float("nan"), 0.1]}, "window_seconds\\[1\\]"),
     ({"activation_bytes": [10]}, "L\\+1 >= 2")],
)
def test_problem_validation(over, match):
    with pytest.raises(ValueError, match=match):
        ScheduleProblem(**_kw(**over))


def test_problem_recompute_cost():
    p = ScheduleProblem(**_kw(n=4, forward_seconds=[1.0, 2.0, 4.0, 8.0]))
    assert p.recompute_seconds(0, 1) == 0
    assert p.recompute_seconds(0, 3) == 3.0  # layers 0 and 1 re-run; layer 2 runs with grad anyway
    assert p.recompute_seconds(1, 4) == 6.0
    assert p.num_layers == 4
