"""Solver with the engine's transfer rules (``solve(engine_windows=True)``) against brute force.

The reference is written from the engine's timeline, not from `milp_transfers.py`'s index sets. One step: F_0 ..
F_{L-1} (forward parts, rho_w), HEAD, then the backward blocks from the top, block (s, e) being B_{e-1} .. B_s
(backward parts, window - rho). An offload runs in F_i .. F_{L-1} (a CPU one also in HEAD: the forward waits for
spill writes before the head); the reload of a block's start runs during the block above it (HEAD for the
topmost block), as `engine/stack.py` starts it.
"""

import itertools
import random

import highspy
import pytest
from test_schedule_milp import random_problem

from lightning_lazytrain.schedule import ScheduleProblem, solve

GIB = 1 << 30


def transfer_cost(p: ScheduleProblem, tiers: list[str]) -> float:
    """Least charged slack seconds for a fixed tier assignment (transfers placed optimally)."""
    n = p.num_layers
    saved = [i for i, t in enumerate(tiers) if t != "recompute"]
    block_end = {s: e for s, e in zip(saved[:-1], saved[1:], strict=True)}
    movers = [i for i in range(1, n) if tiers[i] in ("cpu", "nvme") and p.activation_bytes[i] > 0]
    if not movers:
        return 0.0
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    fwd = {("F", w): p.forward_seconds[w] for w in range(n)}
    bwd = {("B", w): max(0.0, p.window_seconds[w] - p.forward_seconds[w]) for w in range(n)}
    parts = {**fwd, ("H", n): p.head_seconds, **bwd}
    h2d = {("B", w): p.param_h2d_bytes[w] / 2 for w in range(n)}
    use = {(part, link): [] for part in parts for link in ("D", "H", "W", "R")}
    for i in movers:
        a = p.activation_bytes[i] / float(GIB)
        nvme = tiers[i] == "nvme"
        out = [("F", w) for w in range(i, n)] + ([] if nvme else [("H", n)])
        e = block_end[i]
        back = [("H", n)] if e == n else [("B", w) for w in range(e, block_end[e])]
        off = [h.addVariable(lb=0) for _ in out]
        rel = [h.addVariable(lb=0) for _ in back]
        h.addConstr(sum(off) == a)
        h.addConstr(sum(rel) == a)
        for v, part in zip(off, out, strict=True):
            use[part, "D"].append(v)
            if nvme:
                use[part, "W"].append(v)
        for v, part in zip(rel, back, strict=True):
            use[part, "H"].append(v)
            if nvme:
                use[part, "R"].append(v)
    bw = {"D": p.d2h_bytes_per_s, "H": p.h2d_bytes_per_s, "W": p.nvme_write_bytes_per_s, "R": p.nvme_read_bytes_per_s}
    cost = 0
    for (part, link), vars_ in use.items():
        if not vars_:
            continue
        cap = parts[part] * bw[link] - (h2d.get(part, 0.0) if link == "H" else 0.0)
        slack = h.addVariable(lb=0)
        h.addConstr(sum(vars_) <= max(cap, 0.0) / float(GIB) + slack)
        cost = cost + slack * (float(GIB) / bw[link])
    h.minimize(cost)
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    return float(h.getInfo().objective_function_value)


def plan_cost(p: ScheduleProblem, tiers: list[str]) -> float | None:
    n, a = p.num_layers, p.activation_bytes
    saved = [i for i, t in enumerate(tiers) if t != "recompute"]
    if any(e - s > p.max_recompute_span for s, e in zip(saved[:-1], saved[1:], strict=True)):
        return None
    for tier, budget in (("gpu", p.gpu_budget_bytes), ("cpu", p.cpu_budget_bytes), ("nvme", p.nvme_budget_bytes)):
        if sum(a[i] for i in range(n + 1) if tiers[i] == tier) > budget:
            return None
    cost = sum(sum(p.forward_seconds[s : e - 1]) for s, e in zip(saved[:-1], saved[1:], strict=True))
    cost += sum(p.lambda_materialize for t in tiers[1:-1] if t != "recompute")
    cost += sum({"cpu": p.lambda_cpu, "nvme": p.lambda_nvme}.get(t, 0.0) for t in tiers)
    return cost + transfer_cost(p, tiers)


@pytest.mark.parametrize("seed", range(14))
def test_engine_windows_objective_matches_brute_force(seed):
    p = random_problem(random.Random(seed), n=3 + seed % 3)
    costs = [(c, t) for inner in itertools.product(("gpu", "cpu", "nvme", "recompute"), repeat=p.num_layers - 1)
             if (c := plan_cost(p, t := ["gpu", *inner, "gpu"])) is not None]
    if not costs:
        return
    best = min(c for c, _ in costs)
    s = solve(p, time_limit=30, mip_gap=1e-9, engine_windows=True)
    assert s.objective == pytest.approx(best, rel=1e-6, abs=1e-9)
    assert plan_cost(p, s.tiers) == pytest.approx(best, rel=1e-6, abs=1e-9)
