"""The stall the plan predicts, worked by hand on tiny timelines (milp_transfers.py's rules, exposure.py).

Each case is one the aggregated-window model of before called hidden (0 s) and the engine does not hide: the
topmost block's reload has only the head to run in, an NVMe write only the forward, a reload only the block above.
"""

import pytest

from lightning_lazytrain.schedule import ScheduleProblem, solve
from lightning_lazytrain.schedule.exposure import predicted_exposure

GIB = 1 << 30


def _problem(n: int, *, head: float = 0.05, h2d: float = 10, d2h: float = 10, read: float = 4, write: float = 2,
             span: int = 1) -> ScheduleProblem:
    """n layers of rho 0.1 s and window 0.4 s (forward 0.1, backward 0.3), 1 GiB boundaries, no weight traffic."""
    return ScheduleProblem(
        activation_bytes=[GIB] * (n + 1), forward_seconds=[0.1] * n, window_seconds=[0.4] * n,
        param_h2d_bytes=[0] * n, grad_d2h_bytes=[0] * n, gpu_budget_bytes=2 * GIB, cpu_budget_bytes=8 * GIB,
        nvme_budget_bytes=8 * GIB, h2d_bytes_per_s=h2d * GIB, d2h_bytes_per_s=d2h * GIB,
        nvme_read_bytes_per_s=read * GIB, nvme_write_bytes_per_s=write * GIB, max_recompute_span=span,
        head_seconds=head)


def test_topmost_nvme_boundary_hides_only_in_its_forward_and_the_head():
    # offload of boundary 1: forward of layer 1 only (0.1 s): disk writes 0.2 GiB of 1 -> 0.8 / 2 = 0.4 s;
    # reload during the head (0.05 s): H2D 0.5 GiB of 1 -> 0.05 s, disk reads 0.2 GiB -> 0.8 / 4 = 0.2 s
    got = predicted_exposure(_problem(2), ["gpu", "nvme", "gpu"])
    assert got["recompute_seconds"] == 0.0
    assert got["slack_seconds"] == pytest.approx(0.4 + 0.05 + 0.2, rel=1e-6)


def test_topmost_cpu_boundary_reload_has_only_the_head():
    # offload: forward of layer 1 + head = 0.15 s x 10 GiB/s, hidden; reload: 0.05 s x 10 GiB/s = 0.5 of 1 GiB
    got = predicted_exposure(_problem(2), ["gpu", "cpu", "gpu"])
    assert got["slack_seconds"] == pytest.approx(0.05, rel=1e-6)
    # no head: the whole reload waits (1 GiB / 10 GiB/s)
    assert predicted_exposure(_problem(2, head=0.0), ["gpu", "cpu", "gpu"])["slack_seconds"] == pytest.approx(0.1)


def test_reload_runs_only_during_the_block_above():
    # boundary 1 on the CPU, blocks (1,2) and above it (2,3): the reload hides in layer 2's backward (0.3 s at
    # 1 GiB/s = 0.3 GiB), not in layer 3's nor the head: 0.7 GiB exposed = 0.7 s
    tiers = ["gpu", "cpu", "gpu", "gpu", "gpu"]
    got = predicted_exposure(_problem(4, h2d=1, d2h=100), tiers)
    assert got["slack_seconds"] == pytest.approx(0.7, rel=1e-6)
    # boundary 2 recomputed instead: block (1,3) lies under (3,4), whose backward (0.3 s) hides 0.3 GiB of the
    # reload; its re-forward of layer 1 costs rho_1 = 0.1 s
    got = predicted_exposure(_problem(4, h2d=1, d2h=100, span=2),
                             ["gpu", "cpu", "recompute", "gpu", "gpu"])
    assert got["recompute_seconds"] == pytest.approx(0.1)
    assert got["slack_seconds"] == pytest.approx(0.7, rel=1e-6)


def test_weight_copy_of_the_backward_takes_its_share_of_the_link():
    # layer 2's backward also copies its weights once (half of param_h2d_bytes = 0.1 GiB): 0.2 GiB left for the
    # reload of boundary 1 -> 0.8 GiB exposed at 1 GiB/s
    p = _problem(4, h2d=1, d2h=100)
    p.param_h2d_bytes = [0, 0, GIB // 5, 0]
    assert predicted_exposure(p, ["gpu", "cpu", "gpu", "gpu", "gpu"])["slack_seconds"] == pytest.approx(0.8)


def test_solver_prediction_is_its_plans_exposure():
    # GPU holds only the ends, so boundaries 1..3 go to CPU or NVMe (span 1): the solver's predicted seconds are
    # what the exposure LP finds for the plan it returns, and no other plan of the brute force does better
    p = _problem(4, h2d=2, d2h=2, read=1, write=1)
    s = solve(p, mip_gap=1e-9, engine_windows=True)
    assert s.counts()["gpu"] == 2 and s.counts()["recompute"] == 0
    got = predicted_exposure(p, s.homes, s.keep_graph)["exposed_seconds"]
    assert s.predicted_exposed_seconds == pytest.approx(got, rel=1e-6)
    others = [predicted_exposure(p, ["gpu", a, b, c, "gpu"])["exposed_seconds"]
              for a in ("cpu", "nvme") for b in ("cpu", "nvme") for c in ("cpu", "nvme")]
    assert got == pytest.approx(min(others), rel=1e-6) and got > 0.1


def test_predicted_stall_is_the_unhidden_transfers_and_the_step_start_weight_copy():
    # the ends fill the 2 GiB GPU budget, so boundary 1 goes to the CPU: its reload has only the head (0.05 s of
    # 1 GiB at 10 GiB/s exposed); the first layer's 0.5 GiB weight slot crosses at 10 GiB/s before anything runs
    p = _problem(2)
    p.slot_bytes = GIB // 2
    s = solve(p, mip_gap=1e-9, engine_windows=True)
    assert s.homes == ["gpu", "cpu", "gpu"]
    assert p.step_start_seconds == pytest.approx(0.05)
    assert s.predicted_stall_seconds == pytest.approx(0.05 + 0.05, rel=1e-6)
    # re-forwards are compute, not stall: a recompute plan's stall is the weight copy alone
    p.cpu_budget_bytes = p.nvme_budget_bytes = 0
    p.max_recompute_span = 2
    s = solve(p, mip_gap=1e-9, engine_windows=True)
    assert s.homes == ["gpu", "recompute", "gpu"] and s.predicted_exposed_seconds == pytest.approx(0.1)
    assert s.predicted_stall_seconds == pytest.approx(0.05, rel=1e-6)
