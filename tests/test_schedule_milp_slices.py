"""Row slices (``layer_micro_batches="auto"``) against brute force: the fewest slices some plan fits in.

`plan_problem` tries 1, 2, 4, ... slices and takes the first whose problem `plan_exists` passes. Reference: for each
slice count, `milp_brute_force.fits` over every tier assignment x every kept-graph choice of that problem (its
working sets divided as `micro_batch_working_bytes` says); the fewest counts that fit must be what "auto" takes,
and the solve of that problem must reach the brute-force optimum. `plan_exists` is exact where boundaries and
working sets are all equal, and never passes a problem no plan fits otherwise (so "auto" never takes too few).
"""

import itertools
import random

import pytest
from milp_brute_force import GIB, HOMES, brute_force, choice_of, choices, fits, plan_cost

from lightning_lazytrain.schedule import InfeasibleScheduleError, Profile, ScheduleProblem, solve
from lightning_lazytrain.schedule.feasibility import plan_exists
from lightning_lazytrain.schedule.plan_problem import micro_batch_candidates, plan_problem

ROWS = 4


def _profile(rng: random.Random, n: int, equal_work: bool) -> Profile:
    a, param = rng.randint(1, 2) * GIB // 8, rng.randint(1, 3) * GIB // 16
    work = [rng.randint(4, 16) * GIB // 4 for _ in range(1 if equal_work else n)]
    return Profile(
        forward_seconds=[rng.uniform(0.01, 0.05) for _ in range(n)],
        activation_bytes=[a] * (n + 1),
        param_bytes=[param] * n,
        head_seconds=0.01,
        h2d_bytes_per_s=rng.uniform(2, 12) * GIB,
        d2h_bytes_per_s=rng.uniform(2, 12) * GIB,
        duplex_bytes_per_s=20 * GIB,
        nvme_read_bytes_per_s=GIB,
        nvme_write_bytes_per_s=GIB,
        device_name="brute force",
        sources=dict.fromkeys(
            ("forward_seconds", "head_seconds", "h2d", "d2h", "duplex", "nvme_read", "nvme_write"), "analytic"
        ),
        batch=ROWS,
        dtype="bfloat16",
        graph_bytes=[rng.randint(1, 4) * GIB // 8 for _ in range(n)],
        working_bytes=work * n if equal_work else work,
    )


def _problems(seed: int) -> dict:
    """One random setting's problem for "auto" and for each slice count it may take."""
    rng = random.Random(seed)
    n, equal_work = 3 + seed % 2, seed % 3 != 2
    profile = _profile(rng, n, equal_work)
    a = profile.activation_bytes[0]
    settings = dict(
        total_bytes=int(
            rng.uniform(0.4, 1.2) * (max(profile.working_bytes) + (n + 3) * a + 4 * profile.param_bytes[0])
        ),
        slot_bytes=profile.param_bytes[0],
        prefetch_depth=rng.choice([1, 2]),
        loss_chunk_bytes=a // 4,
        head_grad_bytes=0,
        max_recompute_span=rng.randint(1, n),
        keep_graph_layers=rng.choice([0, 0, 1]),
    )
    budgets = (rng.randint(2, n + 1) * a, rng.randint(0, n) * a, rng.randint(0, 1) * a)
    return {
        k: plan_problem(profile, *budgets, **settings, micro_batches=k) for k in ["auto", *micro_batch_candidates(ROWS)]
    }


def _some_plan_fits(p: ScheduleProblem) -> bool:
    per_layer = [choices(p, j) for j in range(p.num_layers)]
    return any(
        fits(p, ["gpu", *inner, "gpu"], choice)
        for inner in itertools.product(HOMES, repeat=p.num_layers - 1)
        for choice in itertools.product(*per_layer)
    )


@pytest.mark.parametrize("seed", range(18))
def test_auto_slices_are_the_fewest_some_plan_fits_in(seed):
    problems = _problems(seed)
    counts = micro_batch_candidates(ROWS)
    fit = {k: _some_plan_fits(problems[k]) for k in counts}
    equal = len(set(problems[1].working_bytes)) == 1
    for k in counts:
        passed = plan_exists(problems[k])
        assert passed == fit[k] if equal else (fit[k] or not passed), (k, passed, fit[k])
    fewest = next((k for k in counts if fit[k]), counts[-1])
    auto = problems["auto"]
    assert auto.micro_batches == fewest if equal else auto.micro_batches >= fewest
    assert auto == problems[auto.micro_batches]
    ref = brute_force(auto)
    if ref is None:
        with pytest.raises(InfeasibleScheduleError):
            solve(auto, mip_gap=1e-9)
        return
    s = solve(auto, time_limit=30, mip_gap=1e-9)
    assert s.micro_batches == auto.micro_batches
    assert s.objective == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    assert plan_cost(auto, s.homes, choice_of(s)) == pytest.approx(ref[0], rel=1e-6, abs=1e-9)


def test_slice_instances_are_not_trivial():
    """Some setting fits whole, some only in two or four slices, some in none; some has unequal working sets."""
    fewest, unequal = set(), 0
    for seed in range(18):
        problems = _problems(seed)
        fit = [k for k in micro_batch_candidates(ROWS) if _some_plan_fits(problems[k])]
        fewest.add(fit[0] if fit else None)
        unequal += len(set(problems[1].working_bytes)) > 1
    assert fewest == {1, 2, 4, None} and unequal
