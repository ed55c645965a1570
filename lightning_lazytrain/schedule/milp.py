"""The activation-placement MILP (LazyTrain Eq. 1-7, full problem), built in Pyomo and solved with HiGHS.

Model as implemented (layers j = 0..L-1, layer j reads boundary j and writes j+1; bytes are scaled to GiB inside):

* Edges ``x(s,e)`` binary for ``0 <= s < e <= min(L, s + max_recompute_span)``: block (s, e) is chosen. Its
  recompute cost is ``R(s,e) = sum(rho_s .. rho_{e-2})`` (0 for e = s+1).
* Homes ``g_i, c_i, n_i`` binary for interior boundaries 1..L-1, ``z_i = g_i + c_i + n_i <= 1``; boundaries 0 and
  L are on the GPU. Flow conservation: one edge leaves 0, one enters L, and for interior i
  ``sum_s x(s,i) = sum_e x(i,e) = z_i``, so the chosen edges are one path 0 -> L through the saved boundaries.
* Budgets: ``A_0 + A_L + sum A_i g_i <= M_G``, ``sum A_i c_i <= M_C``, ``sum A_i n_i <= M_N``.
* Windows: w = 0..L-1 is layer w's compute (forward + backward, ``window_seconds[w]``); w = L is the head window
  (lm_head + loss, ``head_seconds``), which sits after the last forward and before the first backward.
* Offload (D2H) of boundary i: ``dc(i,w)`` (to CPU) / ``dn(i,w)`` (to NVMe) for windows ``w = i..L``: during the
  forward of layers i.. L-1 (boundary i exists once layer i-1 wrote it) or the head window.
  ``sum_w dc(i,w) = A_i c_i``, ``sum_w dn(i,w) = A_i n_i``.
* Reload (H2D) of boundary i: ``hc(i,w)`` / ``hn(i,w)`` for windows ``w = i+1..L``, and for a real window only if
  the block leaving i is (i, e) with ``e <= w``: ``hc(i,w) + hn(i,w) <= A_i * sum_{e<=w} x(i,e)``. The backward
  of layer w >= e finishes before block (i, e)'s backward starts (its re-forward from i, or layer i's backward
  when e = i+1), so the reload is ready in time. This is stricter than the paper's ``w >= i``, which lets a reload
  overlap the layer that consumes it. ``sum_w hc = A_i c_i``, ``sum_w hn = A_i n_i``.
* NVMe traffic passes through host memory, so in its window it uses the PCIe link *and* the disk (a bounce buffer
  streams it; same window for both).
* Per window and direction: ``sum_i (dc+dn)(i,w) <= free_D(w) + dD(w)`` with
  ``free_D(w) = max(0, W_w * B_D - G_w)``; ``sum_i (hc+hn)(i,w) <= free_H(w) + dH(w)`` with
  ``free_H(w) = max(0, W_w * B_H - P_w)``; ``sum_i dn(i,w) <= W_w * B_W + eW(w)``; ``sum_i hn(i,w) <= W_w * B_R
  + eR(w)``. The slacks dD, dH, eW, eR >= 0 are the bytes above the activation-free baseline
  ``max(0, mandatory - capacity)``: only they are charged.
* Objective (seconds): ``sum R x + lambda_z sum z + lambda_c sum c + lambda_n sum n
  + sum_w (dD/B_D + dH/B_H + eW/B_W + eR/B_R)``.

``predicted_exposed_seconds`` = recompute seconds ``sum R x`` + charged slack seconds (the four slack terms), i.e.
the objective without tie-breakers. PCIe and disk slack of one window are added, not max'ed: an upper estimate.
Kept graphs, weight slots and each block's transient memory (rebuilt boundaries, working set) are added by
``milp_memory.py``; the re-run a kept graph saves, ``rho_j (1 - k_j)``, is in the objective, not in
``predicted_exposed_seconds``.
"""

from __future__ import annotations

import logging
import math
import time

import pyomo.environ as pyo
from pyomo.contrib.appsi.base import TerminationCondition
from pyomo.contrib.appsi.solvers import Highs

from .milp_memory import add_memory, memory_shortfall, plan_gpu_bytes
from .problem import GIB, ScheduleProblem
from .schedule import Schedule, Transfer

log = logging.getLogger(__name__)


class InfeasibleScheduleError(ValueError):
    """No plan fits the budgets; the message names the tier and the shortfall in GiB."""


def min_stored_bytes(problem: ScheduleProblem) -> tuple[int, list[int]]:
    """Fewest activation bytes any plan must save (boundaries 0 and L included) and the boundaries achieving it.

    Shortest path over boundaries with node weights A_i and hops of at most max_recompute_span.
    """
    a, n, span = problem.activation_bytes, problem.num_layers, problem.max_recompute_span
    best = [math.inf] * (n + 1)
    prev = [-1] * (n + 1)
    best[0] = a[0]
    for i in range(1, n + 1):
        for s in range(max(0, i - span), i):
            if best[s] + a[i] < best[i]:
                best[i], prev[i] = best[s] + a[i], s
    path, i = [], n
    while i >= 0:
        path.append(i)
        i = prev[i]
    return int(best[n]), path[::-1]


def precheck(problem: ScheduleProblem) -> None:
    """Cheap necessary conditions; raises InfeasibleScheduleError with a GiB shortfall and what would fix it."""
    a = problem.activation_bytes
    ends = a[0] + a[-1]
    if ends > problem.gpu_budget_bytes:
        short = (ends - problem.gpu_budget_bytes) / GIB
        raise InfeasibleScheduleError(
            f"GPU activation budget short by {short:.3f} GiB: boundaries 0 and L must stay on the GPU and need "
            f"{ends / GIB:.3f} GiB, budget is {problem.gpu_budget_bytes / GIB:.3f} GiB; raise the gpu budget or "
            f"lower the batch / sequence length")
    if (short := memory_shortfall(problem)) is not None:
        raise InfeasibleScheduleError(short)
    forced = sum(problem.graph_bytes[j] for j in problem.keep_graph_layers) if problem.graph_bytes else 0
    if ends + forced > problem.gpu_budget_bytes:
        raise InfeasibleScheduleError(
            f"GPU activation budget short by {(ends + forced - problem.gpu_budget_bytes) / GIB:.3f} GiB: the graphs "
            f"of keep_graph_layers {problem.keep_graph_layers} need {forced / GIB:.3f} GiB beside boundaries 0 and "
            f"L; keep fewer graphs or raise the gpu budget")
    need, _ = min_stored_bytes(problem)
    have = problem.gpu_budget_bytes + problem.cpu_budget_bytes + problem.nvme_budget_bytes
    if need > have:
        raise InfeasibleScheduleError(
            f"GPU+CPU+NVMe activation budget short by {(need - have) / GIB:.3f} GiB: with max_recompute_span="
            f"{problem.max_recompute_span} at least {need / GIB:.3f} GiB of boundaries must be saved, budgets are "
            f"gpu {problem.gpu_budget_bytes / GIB:.3f} + cpu {problem.cpu_budget_bytes / GIB:.3f} + nvme "
            f"{problem.nvme_budget_bytes / GIB:.3f} GiB; raise the gpu/cpu budget, lower the batch, add a spill dir "
            f"(nvme budget), or allow a longer max_recompute_span")


def _build(p: ScheduleProblem) -> pyo.ConcreteModel:
    n, span = p.num_layers, p.max_recompute_span
    a = [v / GIB for v in p.activation_bytes]
    wins = list(range(n + 1))  # n = head window
    secs = list(p.window_seconds) + [p.head_seconds]
    p_h2d = list(p.param_h2d_bytes) + [0]
    g_d2h = list(p.grad_d2h_bytes) + [0]
    free_d = [max(0.0, secs[w] * p.d2h_bytes_per_s - g_d2h[w]) / GIB for w in wins]
    free_h = [max(0.0, secs[w] * p.h2d_bytes_per_s - p_h2d[w]) / GIB for w in wins]
    cap_w = [secs[w] * p.nvme_write_bytes_per_s / GIB for w in wins]
    cap_r = [secs[w] * p.nvme_read_bytes_per_s / GIB for w in wins]
    # A layer that keeps its graph runs no forward-with-grad in its backward and needs one weight copy, not two.
    kept = [secs[w] - (p.forward_seconds[w] if w < n else 0.0) for w in wins]
    kfree_d = [max(0.0, kept[w] * p.d2h_bytes_per_s - g_d2h[w]) / GIB for w in wins]
    kfree_h = [max(0.0, kept[w] * p.h2d_bytes_per_s - p_h2d[w] / 2) / GIB for w in wins]
    kcap_w = [kept[w] * p.nvme_write_bytes_per_s / GIB for w in wins]
    kcap_r = [kept[w] * p.nvme_read_bytes_per_s / GIB for w in wins]
    # Boundaries with zero bytes never need traffic; keep them in the model (they may still be homes) but
    # give them no transfer variables so the LP stays small.
    inner = list(range(1, n))
    moving = [i for i in inner if a[i] > 0]
    edges = [(s, e) for s in range(n) for e in range(s + 1, min(n, s + span) + 1)]
    off_idx = [(i, w) for i in moving for w in range(i, n + 1)]
    rel_idx = [(i, w) for i in moving for w in range(i + 1, n + 1)]

    m = pyo.ConcreteModel()
    m.x = pyo.Var(edges, domain=pyo.Binary)
    m.g = pyo.Var(inner, domain=pyo.Binary)
    m.c = pyo.Var(inner, domain=pyo.Binary)
    m.n = pyo.Var(inner, domain=pyo.Binary)
    m.dc = pyo.Var(off_idx, domain=pyo.NonNegativeReals)
    m.dn = pyo.Var(off_idx, domain=pyo.NonNegativeReals)
    m.hc = pyo.Var(rel_idx, domain=pyo.NonNegativeReals)
    m.hn = pyo.Var(rel_idx, domain=pyo.NonNegativeReals)
    m.sD = pyo.Var(wins, domain=pyo.NonNegativeReals)
    m.sH = pyo.Var(wins, domain=pyo.NonNegativeReals)
    m.sW = pyo.Var(wins, domain=pyo.NonNegativeReals)
    m.sR = pyo.Var(wins, domain=pyo.NonNegativeReals)

    out_e: dict[int, list[int]] = {i: [] for i in range(n + 1)}
    in_s: dict[int, list[int]] = {i: [] for i in range(n + 1)}
    for s, e in edges:
        out_e[s].append(e)
        in_s[e].append(s)
    off_w = {i: range(i, n + 1) for i in moving}
    rel_w = {i: range(i + 1, n + 1) for i in moving}
    by_w_off: dict[int, list[int]] = {w: [i for i in moving if i <= w] for w in wins}
    by_w_rel: dict[int, list[int]] = {w: [i for i in moving if i < w] for w in wins}
    qs = pyo.quicksum

    m.src = pyo.Constraint(expr=qs(m.x[0, e] for e in out_e[0]) == 1)
    m.sink = pyo.Constraint(expr=qs(m.x[s, n] for s in in_s[n]) == 1)
    m.home = pyo.Constraint(inner, rule=lambda m, i: m.g[i] + m.c[i] + m.n[i] <= 1)
    m.fout = pyo.Constraint(inner, rule=lambda m, i: qs(m.x[i, e] for e in out_e[i]) == m.g[i] + m.c[i] + m.n[i])
    m.fin = pyo.Constraint(inner, rule=lambda m, i: qs(m.x[s, i] for s in in_s[i]) == m.g[i] + m.c[i] + m.n[i])
    add_memory(m, p, a, inner, edges)
    if inner:  # a 1-layer model has no interior boundary, hence nothing to budget (precheck covered 0 and L)
        m.bud_c = pyo.Constraint(expr=qs(a[i] * m.c[i] for i in inner) <= p.cpu_budget_bytes / GIB)
        m.bud_n = pyo.Constraint(expr=qs(a[i] * m.n[i] for i in inner) <= p.nvme_budget_bytes / GIB)
    m.off_c = pyo.Constraint(moving, rule=lambda m, i: qs(m.dc[i, w] for w in off_w[i]) == a[i] * m.c[i])
    m.off_n = pyo.Constraint(moving, rule=lambda m, i: qs(m.dn[i, w] for w in off_w[i]) == a[i] * m.n[i])
    m.rel_c = pyo.Constraint(moving, rule=lambda m, i: qs(m.hc[i, w] for w in rel_w[i]) == a[i] * m.c[i])
    m.rel_n = pyo.Constraint(moving, rule=lambda m, i: qs(m.hn[i, w] for w in rel_w[i]) == a[i] * m.n[i])
    # Reload in real window w only once the block leaving i ends at or before w (see module docstring).
    link_idx = [(i, w) for (i, w) in rel_idx if w < n]
    m.link = pyo.Constraint(link_idx, rule=lambda m, i, w: m.hc[i, w] + m.hn[i, w]
                            <= a[i] * qs(m.x[i, e] for e in out_e[i] if e <= w))

    def cap(base: list[float], keep: list[float], w: int):
        return base[w] + (keep[w] - base[w]) * m.k[w] if w in m.k else base[w]

    m.capD = pyo.Constraint(wins, rule=lambda m, w: qs(m.dc[i, w] + m.dn[i, w] for i in by_w_off[w])
                            <= cap(free_d, kfree_d, w) + m.sD[w])
    m.capH = pyo.Constraint(wins, rule=lambda m, w: qs(m.hc[i, w] + m.hn[i, w] for i in by_w_rel[w])
                            <= cap(free_h, kfree_h, w) + m.sH[w])
    m.capW = pyo.Constraint(wins, rule=lambda m, w: qs(m.dn[i, w] for i in by_w_off[w])
                            <= cap(cap_w, kcap_w, w) + m.sW[w])
    m.capR = pyo.Constraint(wins, rule=lambda m, w: qs(m.hn[i, w] for i in by_w_rel[w])
                            <= cap(cap_r, kcap_r, w) + m.sR[w])

    m.recompute = pyo.Expression(expr=qs(p.recompute_seconds(s, e) * m.x[s, e] for s, e in edges))
    m.slack = pyo.Expression(expr=qs(
        m.sD[w] * (GIB / p.d2h_bytes_per_s) + m.sH[w] * (GIB / p.h2d_bytes_per_s)
        + m.sW[w] * (GIB / p.nvme_write_bytes_per_s) + m.sR[w] * (GIB / p.nvme_read_bytes_per_s) for w in wins))
    m.ties = pyo.Expression(expr=qs(
        p.lambda_materialize * (m.g[i] + m.c[i] + m.n[i]) + p.lambda_cpu * m.c[i] + p.lambda_nvme * m.n[i]
        for i in inner))
    # Where a layer may keep its graph, its backward's forward-with-grad re-run is a cost it can avoid: counted as
    # rho_j (1 - k_j), so the objective stays the seconds of re-runs and stalls (and the MIP gap is relative to it).
    m.graph_saving = pyo.Expression(expr=qs(p.forward_seconds[j] * m.k[j] for j in m.k))
    m.reruns = pyo.Expression(expr=qs(p.forward_seconds[j] * (1 - m.k[j]) for j in m.k))
    m.obj = pyo.Objective(expr=m.recompute + m.slack + m.ties + m.reruns, sense=pyo.minimize)
    m._edges, m._off, m._rel, m._inner = edges, off_idx, rel_idx, inner
    return m


def _status(tc: TerminationCondition) -> str:
    return {TerminationCondition.optimal: "optimal", TerminationCondition.maxTimeLimit: "time_limit",
            TerminationCondition.maxIterations: "iteration_limit",
            TerminationCondition.objectiveLimit: "objective_limit"}.get(tc, str(tc.name))


def solve(problem: ScheduleProblem, time_limit: float = 10.0, mip_gap: float = 0.01,
          threads: int | None = None) -> Schedule:
    """Solve the full placement MILP; returns the best plan found within ``time_limit`` seconds / ``mip_gap``.

    Raises InfeasibleScheduleError when no plan fits the budgets (pre-check or solver), RuntimeError when HiGHS
    stops without any feasible plan for another reason (e.g. the time limit hit before the first incumbent).
    """
    precheck(problem)
    t0 = time.perf_counter()
    m = _build(problem)
    opt = Highs()
    opt.config.load_solution = False
    opt.config.stream_solver = False
    # Translate to HiGHS up front so the time limit we hand HiGHS is what is left of the caller's budget.
    opt.set_instance(m)
    t_build = time.perf_counter() - t0
    opt.config.time_limit = max(0.05, float(time_limit) - t_build)
    opt.config.mip_gap = float(mip_gap)
    if threads is not None:
        opt.highs_options = {"threads": int(threads)}
    res = opt.solve(m)
    t_total = time.perf_counter() - t0
    tc = res.termination_condition
    if tc in (TerminationCondition.infeasible, TerminationCondition.infeasibleOrUnbounded):
        need, _ = min_stored_bytes(problem)
        raise InfeasibleScheduleError(
            f"no plan fits: the saved boundaries cannot be packed into the gpu "
            f"{problem.gpu_budget_bytes / GIB:.3f} / cpu {problem.cpu_budget_bytes / GIB:.3f} / nvme "
            f"{problem.nvme_budget_bytes / GIB:.3f} GiB activation budgets (at least {need / GIB:.3f} GiB must be "
            f"saved with max_recompute_span={problem.max_recompute_span}); raise a budget, lower the batch or add "
            f"a spill dir")
    if res.best_feasible_objective is None:
        raise RuntimeError(f"HiGHS found no plan ({tc.name}) within {time_limit} s; raise the time limit")
    opt.load_vars()
    return _extract(problem, m, res, _status(tc), t_build, t_total)


def _val(v) -> float:
    x = pyo.value(v)
    return 0.0 if x is None else float(x)


def _extract(p: ScheduleProblem, m: pyo.ConcreteModel, res, status: str, t_build: float, t_total: float) -> Schedule:
    n = p.num_layers
    tiers = ["recompute"] * (n + 1)
    tiers[0] = tiers[n] = "gpu"
    for i in m._inner:
        for name in ("g", "c", "n"):
            if _val(getattr(m, name)[i]) > 0.5:
                tiers[i] = {"g": "gpu", "c": "cpu", "n": "nvme"}[name]
    transfers = []
    for var, idx, direction, tier in ((m.dc, m._off, "offload", "cpu"), (m.dn, m._off, "offload", "nvme"),
                                      (m.hc, m._rel, "reload", "cpu"), (m.hn, m._rel, "reload", "nvme")):
        for i, w in idx:
            b = _val(var[i, w]) * GIB
            if b > 1.0:  # drop solver round-off, keep every real byte
                transfers.append(Transfer(boundary=i, window=w, direction=direction, tier=tier, bytes=round(b, 1)))
    obj = float(res.best_feasible_objective)
    bound = res.best_objective_bound
    gap = 0.0 if bound is None or obj == 0 else max(0.0, (obj - float(bound)) / abs(obj))
    keep_graph = [j in m.k and _val(m.k[j]) > 0.5 for j in range(n)]
    graphs = sum(p.graph_bytes[j] for j in range(n) if keep_graph[j]) if p.graph_bytes is not None else 0
    # Re-check the budgets in exact integer bytes: the solver works in GiB floats with a feasibility tolerance.
    for tier, budget in (("gpu", p.gpu_budget_bytes), ("cpu", p.cpu_budget_bytes), ("nvme", p.nvme_budget_bytes)):
        used = sum(b for b, t in zip(p.activation_bytes, tiers, strict=True) if t == tier)
        used += graphs if tier == "gpu" else 0
        if used > budget:
            raise RuntimeError(f"solver plan puts {used} B on {tier} over its {budget} B budget (round-off); "
                               f"lower the {tier} budget by a few KiB")
    gpu_bytes = plan_gpu_bytes(p, tiers, keep_graph)
    if p.gpu_total_bytes is not None and gpu_bytes > p.gpu_total_bytes:
        raise RuntimeError(f"solver plan needs {gpu_bytes} B of GPU memory over the {p.gpu_total_bytes} B the "
                           f"device has for it (round-off); lower gpu_total_bytes by a few KiB")
    sched = Schedule(tiers=tiers, objective=obj, status=status, transfers=transfers, keep_graph=keep_graph,
                     max_recompute_span=p.max_recompute_span)
    recompute = sum(p.recompute_seconds(s, e) for s, e in sched.blocks())
    slack = _val(m.slack)
    sched.predicted_exposed_seconds = recompute + slack
    sched.info = {"recompute_seconds": recompute, "slack_seconds": slack, "mip_gap": gap,
                  "best_bound": None if bound is None else float(bound), "build_seconds": round(t_build, 4),
                  "solve_seconds": round(t_total, 4), "num_binaries": len(m._edges) + 3 * len(m._inner) + len(m.k),
                  "kept_graph_seconds": _val(m.graph_saving), "gpu_bytes": gpu_bytes}
    log.info("schedule solved: %s in %.2f s (gap %.4f), exposed %.4f s, tiers %s", status, t_total, gap,
             sched.predicted_exposed_seconds, sched.counts())
    return sched
