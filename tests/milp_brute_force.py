"""The brute-force reference of the placement MILP tests: every tier assignment x every per-layer graph choice.

Each plan is costed from the step's timeline, not from the MILP's index sets, so a wrong row in `milp*.py` shows up
as an objective mismatch. Per layer the choices are ``NONE`` (re-run in the backward), ``WHOLE`` (keep the graph
from the forward) and ``PART`` (keep it, the MLP re-runs: ``mlp_graph_bytes`` held, ``mlp_seconds`` charged), each
where the problem offers it. Transfers are placed by an LP (highspy, not Pyomo) over one of two timelines:

* `window_transfers`, the paper's aggregated windows: F_w and B_w share window w's capacity, the head is window L;
  an offload of boundary i runs from F_i to the head, its reload from the head until its block's backward starts.
* `engine_transfers`, the engine's own order (`engine/compute/stack.py`): F_0 .. F_{L-1} (forward parts), the head, then
  the backward blocks from the top, block (s, e) being B_{e-1} .. B_s (backward parts). An offload runs in
  F_i .. F_{L-1} (a CPU one also in the head: the forward waits for spill writes before the head). The reload of a
  block's start is started by the nearest block above that reads its own input back (a kept graph reads none), or
  by the forward's end when there is none, and runs until the block's own backward starts.

A layer holding a graph from the forward runs no re-run in its backward (one ``reruns[w]`` less) and copies its
weights once (half of ``param_h2d_bytes[w]``, none in the backward). A ``PART`` layer gets a kept layer's window,
the MILP's lower estimate (``milp_memory.py``): its MLP's re-run is not counted as time transfers can hide in.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Sequence

import highspy

from lightning_lazytrain.schedule import ScheduleProblem

GIB = 1 << 30
NONE, WHOLE, PART = 0, 1, 2
HOMES = ("gpu", "cpu", "nvme", "recompute")

Transfers = Callable[[ScheduleProblem, Sequence[str], Sequence[bool]], float]


def random_problem(rng: random.Random, n: int) -> ScheduleProblem:
    """Small instances where transfers are tight, so homes, windows and recompute all compete."""
    a = [rng.randint(1, 4) * GIB // 4 for _ in range(n + 1)]
    total = sum(a)
    fwd = [rng.uniform(0.01, 0.05) for _ in range(n)]
    return ScheduleProblem(
        activation_bytes=a,
        forward_seconds=fwd,
        window_seconds=[3 * f * rng.uniform(0.5, 1.5) for f in fwd],
        param_h2d_bytes=[rng.randint(0, 3) * GIB // 8 for _ in range(n)],
        grad_d2h_bytes=[rng.randint(0, 3) * GIB // 8 for _ in range(n)],
        gpu_budget_bytes=a[0] + a[n] + int(rng.uniform(0, 0.5) * total),
        cpu_budget_bytes=int(rng.uniform(0, 0.4) * total),
        nvme_budget_bytes=int(rng.uniform(0.1, 0.8) * total),
        h2d_bytes_per_s=rng.uniform(2, 12) * GIB,
        d2h_bytes_per_s=rng.uniform(2, 12) * GIB,
        nvme_read_bytes_per_s=rng.uniform(1, 10) * GIB,
        nvme_write_bytes_per_s=rng.uniform(1, 10) * GIB,
        max_recompute_span=rng.randint(2, n),
        head_seconds=rng.choice([0.0, 0.02]),
        lambda_materialize=1e-5,
        lambda_cpu=1e-6,
        lambda_nvme=3e-6,
    )


def memory_problem(seed: int) -> ScheduleProblem:
    """`random_problem` with kept graphs offered, working sets, weight slots and a device total that cuts some."""
    rng = random.Random(1000 + seed)
    n = 3 + seed % 2
    p = random_problem(rng, n)
    graph = [rng.randint(1, 4) * GIB // 8 for _ in range(n)]
    work = [rng.randint(1, 6) * GIB // 4 for _ in range(n)]
    slot = rng.choice([0, GIB // 8])
    total = sum(p.activation_bytes) + sum(graph) // 2 + max(work) + 3 * slot
    return dataclasses.replace(
        p,
        graph_bytes=graph,
        working_bytes=work,
        head_working_bytes=rng.randint(0, 4) * GIB // 4,
        slot_bytes=slot,
        fixed_slots=1,
        gpu_total_bytes=int(total * rng.uniform(0.7, 1.3)),
        gpu_budget_bytes=p.gpu_budget_bytes + rng.randint(0, 3) * GIB // 2,
        keep_graph_layers=[n - 1] if seed % 4 == 3 else [],
        # the re-run skips the MLP's output projection: a share of the forward, drawn last so the rest stays as it was
        rerun_seconds=[f * rng.uniform(0.6, 1.0) for f in p.forward_seconds],
    )


def mlp_problem(seed: int) -> ScheduleProblem:
    """`memory_problem` with the MLP re-run offered too."""
    p = memory_problem(seed)
    rng = random.Random(2000 + seed)
    # the MLP is most of a layer's graph and a third to a half of its forward
    part = [g * rng.randint(2, 5) // 10 for g in p.graph_bytes]
    mu = [f * rng.uniform(0.3, 0.6) for f in p.forward_seconds]
    return dataclasses.replace(p, mlp_graph_bytes=part, mlp_seconds=mu)


def blocks_of(tiers: Sequence[str]) -> list[tuple[int, int]]:
    saved = [i for i, t in enumerate(tiers) if t != "recompute"]
    return list(zip(saved[:-1], saved[1:], strict=True))


def _movers(p: ScheduleProblem, tiers: Sequence[str]) -> list[int]:
    return [i for i in range(1, p.num_layers) if tiers[i] in ("cpu", "nvme") and p.activation_bytes[i] > 0]


def _least_slack(
    p: ScheduleProblem,
    tiers: Sequence[str],
    parts: dict,
    h2d_due: dict,
    d2h_due: dict,
    offload: Callable[[int], list],
    reload: Callable[[int], list],
) -> float:
    """The LP: each mover's bytes spread over its offload parts and its reload parts; per part and link, the bytes
    beyond ``seconds * bandwidth - due`` are slack, charged at 1 / bandwidth."""
    movers = _movers(p, tiers)
    if not movers:
        return 0.0
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    use = {(part, link): [] for part in parts for link in "DHWR"}
    for i in movers:
        a, nvme = p.activation_bytes[i] / float(GIB), tiers[i] == "nvme"
        for parts_of, links in ((offload(i), "DW"), (reload(i), "HR")):
            shares = [h.addVariable(lb=0) for _ in parts_of]
            h.addConstr(sum(shares) == a)
            for v, part in zip(shares, parts_of, strict=True):
                use[part, links[0]].append(v)
                if nvme:
                    use[part, links[1]].append(v)
    bw = {"D": p.d2h_bytes_per_s, "H": p.h2d_bytes_per_s, "W": p.nvme_write_bytes_per_s, "R": p.nvme_read_bytes_per_s}
    due = {"D": d2h_due, "H": h2d_due}
    cost = 0
    for (part, link), shares in use.items():
        if shares:
            slack = h.addVariable(lb=0)
            room = parts[part] * bw[link] - due.get(link, {}).get(part, 0.0)
            h.addConstr(sum(shares) <= max(room, 0.0) / float(GIB) + slack)
            cost = cost + slack * (float(GIB) / bw[link])
    h.minimize(cost)
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    return float(h.getInfo().objective_function_value)


def window_transfers(p: ScheduleProblem, tiers: Sequence[str], held: Sequence[bool]) -> float:
    """Least charged slack seconds over the aggregated windows (module docstring)."""
    n = p.num_layers
    end = dict(blocks_of(tiers))
    parts = {w: p.window_seconds[w] - (p.reruns[w] if held[w] else 0.0) for w in range(n)} | {n: p.head_seconds}
    h2d = {w: p.param_h2d_bytes[w] / (2 if held[w] else 1) for w in range(n)}
    d2h = {w: float(p.grad_d2h_bytes[w]) for w in range(n)}
    # F_i .. F_{L-1} and the head are windows i..L; the head and B_{L-1} .. B_e are windows e..L
    return _least_slack(
        p, tiers, parts, h2d, d2h, lambda i: list(range(i, n + 1)), lambda i: list(range(end[i], n + 1))
    )


def engine_transfers(p: ScheduleProblem, tiers: Sequence[str], held: Sequence[bool]) -> float:
    """Least charged slack seconds over the engine's timeline (module docstring)."""
    n = p.num_layers
    blocks = blocks_of(tiers)
    end = dict(blocks)
    parts = {("F", w): p.forward_seconds[w] for w in range(n)} | {("H", n): p.head_seconds}
    parts |= {
        ("B", w): max(0.0, p.window_seconds[w] - p.forward_seconds[w] - (p.reruns[w] if held[w] else 0.0))
        for w in range(n)
    }
    h2d = {("B", w): 0.0 if held[w] else p.param_h2d_bytes[w] / 2 for w in range(n)}

    def offload(i: int) -> list:
        return [("F", w) for w in range(i, n)] + ([] if tiers[i] == "nvme" else [("H", n)])

    def reload(i: int) -> list:
        out, s = [], end[i]
        while s < n:  # the blocks above, up to and with the first that reads its input back
            out += [("B", w) for w in range(s, end[s])]
            if not held[s]:
                return out
            s = end[s]
        return [*out, ("H", n)]

    return _least_slack(p, tiers, parts, h2d, {}, offload, reload)


def choices(p: ScheduleProblem, j: int) -> tuple[int, ...]:
    return (NONE,) + ((WHOLE,) if p.may_keep_graph(j) else ()) + ((PART,) if p.may_recompute_mlp(j) else ())


def graph_bytes(p: ScheduleProblem, choice: Sequence[int]) -> list[int]:
    """Per layer, the GPU bytes its choice holds from the forward (0 for a whole graph the problem does not size)."""
    whole = p.graph_bytes or [0] * p.num_layers
    return [whole[j] if c == WHOLE else p.mlp_graph_bytes[j] if c == PART else 0 for j, c in enumerate(choice)]


def gpu_peak(p: ScheduleProblem, tiers: Sequence[str], choice: Sequence[int]) -> int:
    """Largest GPU use over the backward: everything saved and every held graph, plus the running block's slots,
    rebuilt boundaries and largest working set (or the head's working set). Beside those, while a block runs the
    layer above's gradients are still being copied out (one slot's bytes), and, where boundaries may leave the GPU,
    its input and the next block's may both be on the GPU on their way back: two of the largest inner boundary."""
    n, a = p.num_layers, p.activation_bytes
    held = sum(a[i] for i in range(n + 1) if tiers[i] == "gpu") + sum(graph_bytes(p, choice))
    held += (sum(c != NONE for c in choice) + p.fixed_slots) * p.slot_bytes
    returning = max(a[1:n], default=0) if p.cpu_budget_bytes + p.nvme_budget_bytes > 0 else 0
    work = p.working_bytes or [0] * n
    peaks = [p.head_working_bytes + returning]  # the first reload starts there
    for s, e in blocks_of(tiers):
        block = (e - s) * p.slot_bytes + sum(a[s + 1 : e]) + max(work[s:e])
        peaks.append(block + p.slot_bytes + 2 * returning)
    return held + max(peaks)


def fits(p: ScheduleProblem, tiers: Sequence[str], choice: Sequence[int]) -> bool:
    """Whether the plan keeps the span, the kept-graph rules, the three budgets and the device total."""
    n, a = p.num_layers, p.activation_bytes
    blocks = blocks_of(tiers)
    if any(e - s > p.max_recompute_span for s, e in blocks):
        return False
    if any(c != NONE and ((j, j + 1) not in blocks or tiers[j] != "gpu") for j, c in enumerate(choice)):
        return False
    if any(choice[j] != WHOLE for j in p.keep_graph_layers):
        return False
    for tier, budget, extra in (
        ("gpu", p.gpu_budget_bytes, sum(graph_bytes(p, choice))),
        ("cpu", p.cpu_budget_bytes, 0),
        ("nvme", p.nvme_budget_bytes, 0),
    ):
        if sum(a[i] for i in range(n + 1) if tiers[i] == tier) + extra > budget:
            return False
    return p.gpu_total_bytes is None or gpu_peak(p, tiers, choice) <= p.gpu_total_bytes


def compute_cost(p: ScheduleProblem, tiers: Sequence[str], choice: Sequence[int]) -> float:
    """The objective without transfers: re-forwards, the backward's re-runs a layer could have saved, the MLP
    re-runs and the tie-breakers."""
    n = p.num_layers
    cost = sum(sum(p.forward_seconds[s : e - 1]) for s, e in blocks_of(tiers))
    cost += sum(p.reruns[j] for j in range(n) if choice[j] == NONE and len(choices(p, j)) > 1)
    cost += sum(p.mlp_seconds[j] for j in range(n) if choice[j] == PART)
    cost += sum(p.lambda_materialize for t in tiers[1:-1] if t != "recompute")
    return cost + sum({"cpu": p.lambda_cpu, "nvme": p.lambda_nvme}.get(t, 0.0) for t in tiers)


def plan_cost(
    p: ScheduleProblem,
    tiers: Sequence[str],
    choice: Sequence[int] | None = None,
    transfers: Transfers = window_transfers,
) -> float | None:
    """The objective of a plan, or None where it does not fit."""
    choice = tuple(choice or (NONE,) * p.num_layers)
    if not fits(p, tiers, choice):
        return None
    return compute_cost(p, tiers, choice) + transfers(p, tiers, [c != NONE for c in choice])


def brute_force(p: ScheduleProblem, transfers: Transfers = window_transfers):
    """``(objective, tiers, choice)`` of the best plan, or None where none fits. A plan whose cost before its
    transfers is already no better than the best so far needs no LP: transfers only add."""
    best = None
    per_layer = [choices(p, j) for j in range(p.num_layers)]
    for inner in itertools.product(HOMES, repeat=p.num_layers - 1):
        tiers = ["gpu", *inner, "gpu"]
        for choice in itertools.product(*per_layer):
            if not fits(p, tiers, choice):
                continue
            cost = compute_cost(p, tiers, choice)
            if best is not None and cost >= best[0] - 1e-12:
                continue
            cost += transfers(p, tiers, [c != NONE for c in choice])
            if best is None or cost < best[0] - 1e-12:
                best = (cost, tiers, choice)
    return best


def choice_of(schedule) -> tuple[int, ...]:
    """A solved plan's per-layer choice."""
    pairs = zip(schedule.keep_graph, schedule.mlp_recompute, strict=True)
    return tuple(PART if r else WHOLE if k else NONE for k, r in pairs)
