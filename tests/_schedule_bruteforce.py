"""Independent reference for the placement MILP: enumerate every tier assignment, solve the transfer LP directly.

Written from the timeline rather than from the MILP's index sets, so a wrong window rule in `milp.py` shows up
as an objective mismatch. Timeline of one step: F_0 .. F_{L-1}, HEAD, B_{L-1} .. B_0; slots F_w and B_w share
window w's capacity (the aggregated window), HEAD is window L.
"""

from __future__ import annotations

import itertools

import highspy

from lightning_lazytrain.schedule import ScheduleProblem

GIB = float(1 << 30)


def _timeline(n: int) -> list[tuple[str, int]]:
    return [("F", w) for w in range(n)] + [("H", n)] + [("B", w) for w in reversed(range(n))]


def transfer_cost(p: ScheduleProblem, tiers: list[str]) -> float:
    """Least charged slack seconds for a fixed tier assignment (transfers placed optimally)."""
    n = p.num_layers
    tl = _timeline(n)
    saved = [i for i, t in enumerate(tiers) if t != "recompute"]
    block_end = {s: e for s, e in zip(saved[:-1], saved[1:], strict=True)}
    movers = [i for i in range(1, n) if tiers[i] in ("cpu", "nvme") and p.activation_bytes[i] > 0]
    if not movers:
        return 0.0
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    secs = list(p.window_seconds) + [p.head_seconds]
    ph = list(p.param_h2d_bytes) + [0]
    gd = list(p.grad_d2h_bytes) + [0]
    pcie_d = {w: [] for w in range(n + 1)}
    pcie_h = {w: [] for w in range(n + 1)}
    disk_w = {w: [] for w in range(n + 1)}
    disk_r = {w: [] for w in range(n + 1)}
    for i in movers:
        a = p.activation_bytes[i] / GIB
        produced = tl.index(("F", i - 1)) if i >= 1 else -1
        needed = tl.index(("B", block_end[i] - 1))  # the block's backward (re-forward from i) starts here
        head = tl.index(("H", n))
        off = [h.addVariable(lb=0) for pos in range(produced + 1, head + 1)]
        off_w = [tl[pos][1] for pos in range(produced + 1, head + 1)]
        rel = [h.addVariable(lb=0) for pos in range(head, needed)]
        rel_w = [tl[pos][1] for pos in range(head, needed)]
        h.addConstr(sum(off) == a)
        h.addConstr(sum(rel) == a)
        for v, w in zip(off, off_w, strict=True):
            pcie_d[w].append(v)
            if tiers[i] == "nvme":
                disk_w[w].append(v)
        for v, w in zip(rel, rel_w, strict=True):
            pcie_h[w].append(v)
            if tiers[i] == "nvme":
                disk_r[w].append(v)
    cost = 0
    for w in range(n + 1):
        for vars_, cap, bw in ((pcie_d[w], secs[w] * p.d2h_bytes_per_s - gd[w], p.d2h_bytes_per_s),
                               (pcie_h[w], secs[w] * p.h2d_bytes_per_s - ph[w], p.h2d_bytes_per_s),
                               (disk_w[w], secs[w] * p.nvme_write_bytes_per_s, p.nvme_write_bytes_per_s),
                               (disk_r[w], secs[w] * p.nvme_read_bytes_per_s, p.nvme_read_bytes_per_s)):
            if not vars_:
                continue
            slack = h.addVariable(lb=0)
            h.addConstr(sum(vars_) <= max(cap, 0.0) / GIB + slack)
            cost = cost + slack * (GIB / bw)
    h.minimize(cost)
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    return float(h.getInfo().objective_function_value)


def plan_cost(p: ScheduleProblem, tiers: list[str]) -> float | None:
    """Objective of a tier assignment, or None if it breaks a budget or the span."""
    n, a = p.num_layers, p.activation_bytes
    saved = [i for i, t in enumerate(tiers) if t != "recompute"]
    if any(e - s > p.max_recompute_span for s, e in zip(saved[:-1], saved[1:], strict=True)):
        return None
    for tier, budget in (("gpu", p.gpu_budget_bytes), ("cpu", p.cpu_budget_bytes), ("nvme", p.nvme_budget_bytes)):
        if sum(a[i] for i in range(n + 1) if tiers[i] == tier) > budget:
            return None
    cost = sum(sum(p.forward_seconds[s : e - 1]) for s, e in zip(saved[:-1], saved[1:], strict=True))
    for i in range(1, n):
        if tiers[i] != "recompute":
            cost += p.lambda_materialize
        cost += {"cpu": p.lambda_cpu, "nvme": p.lambda_nvme}.get(tiers[i], 0.0)
    return cost + transfer_cost(p, tiers)


def brute_force(p: ScheduleProblem) -> tuple[float, list[str]] | None:
    best = None
    for inner in itertools.product(("gpu", "cpu", "nvme", "recompute"), repeat=p.num_layers - 1):
        tiers = ["gpu", *inner, "gpu"]
        c = plan_cost(p, tiers)
        if c is not None and (best is None or c < best[0] - 1e-12):
            best = (c, tiers)
    return best
