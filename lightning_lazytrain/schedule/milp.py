"""The activation-placement MILP (LazyTrain Eq. 1-7, full problem), built in Pyomo and solved with HiGHS.

Model as implemented (layers j = 0..L-1, layer j reads boundary j and writes j+1; bytes are scaled to GiB inside):

* Edges ``x(s,e)`` binary for ``0 <= s < e <= min(L, s + max_recompute_span)``: block (s, e) is chosen. Its
  recompute cost is ``R(s,e) = sum(rho_s .. rho_{e-2})`` (0 for e = s+1).
* Homes ``g_i, c_i, n_i`` binary for interior boundaries 1..L-1, ``z_i = g_i + c_i + n_i <= 1``; boundaries 0 and
  L are on the GPU. Flow conservation: one edge leaves 0, one enters L, and for interior i
  ``sum_s x(s,i) = sum_e x(i,e) = z_i``, so the chosen edges are one path 0 -> L through the saved boundaries.
* Budgets: ``A_0 + A_L + sum A_i g_i <= M_G``, ``sum A_i c_i <= M_C``, ``sum A_i n_i <= M_N``.
* Transfers: by default the paper's aggregated windows (``milp_windows.py``); with ``engine_windows=True`` the
  engine's own rules (``milp_transfers.py``, slower to solve). Bytes a window cannot hide beside the mandatory
  weight and gradient copies are slack, charged at 1 / bandwidth seconds per byte.
* Objective (seconds): ``sum R x + lambda_z sum z + lambda_c sum c + lambda_n sum n + slack``.

``predicted_exposed_seconds`` = recompute seconds ``sum R x`` + charged slack seconds (the four slack terms), i.e.
the objective without tie-breakers. PCIe and disk slack of one window are added, not max'ed: an upper estimate.
Kept graphs, weight slots and each block's transient memory (rebuilt boundaries, working set) are added by
``milp_memory.py``; the re-run a kept graph saves, ``rho'_j (1 - k_j - r_j) + mu_j r_j`` (``rho'_j``:
``rerun_seconds[j]``, the re-run without the MLP's output projection; ``r_j``: kept but the MLP re-runs, ``mu_j``
its time), is in the objective, not in ``predicted_exposed_seconds``.
"""

from __future__ import annotations

import logging
import math
import time

import pyomo.environ as pyo
from pyomo.contrib.appsi.base import TerminationCondition
from pyomo.contrib.appsi.solvers import Highs

from lightning_lazytrain.engine.plan import Schedule

from .milp_memory import add_memory, held_graph_bytes, memory_shortfall, plan_gpu_pieces
from .milp_transfers import add_transfers
from .milp_windows import add_window_transfers
from .problem import GIB, ScheduleProblem

log = logging.getLogger(__name__)


class InfeasibleScheduleError(ValueError):
    """No plan fits the budgets; the message names the tier and the shortfall in GiB. ``saved_boundaries``: what
    does not fit is the boundaries that must be saved, so a larger CPU or NVMe budget is a way out."""

    def __init__(self, message: str, saved_boundaries: bool = False) -> None:
        super().__init__(message)
        self.saved_boundaries = saved_boundaries


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
            f"(nvme budget), or allow a longer max_recompute_span", saved_boundaries=True)


def _build(p: ScheduleProblem, engine_windows: bool = False) -> pyo.ConcreteModel:
    n, span = p.num_layers, p.max_recompute_span
    a = [v / GIB for v in p.activation_bytes]
    inner = list(range(1, n))
    edges = [(s, e) for s in range(n) for e in range(s + 1, min(n, s + span) + 1)]

    m = pyo.ConcreteModel()
    m.x = pyo.Var(edges, domain=pyo.Binary)
    m.g = pyo.Var(inner, domain=pyo.Binary)
    m.c = pyo.Var(inner, domain=pyo.Binary)
    m.n = pyo.Var(inner, domain=pyo.Binary)

    out_e: dict[int, list[int]] = {i: [] for i in range(n + 1)}
    in_s: dict[int, list[int]] = {i: [] for i in range(n + 1)}
    for s, e in edges:
        out_e[s].append(e)
        in_s[e].append(s)
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
    (add_transfers if engine_windows else add_window_transfers)(m, p, a, inner, out_e)

    m.recompute = pyo.Expression(expr=qs(p.recompute_seconds(s, e) * m.x[s, e] for s, e in edges))
    m.ties = pyo.Expression(expr=qs(
        p.lambda_materialize * (m.g[i] + m.c[i] + m.n[i]) + p.lambda_cpu * m.c[i] + p.lambda_nvme * m.n[i]
        for i in inner))
    # Where a layer may keep its graph, its backward's forward-with-grad re-run is a cost it can avoid: counted as
    # rho'_j (1 - k_j - r_j) + mu_j r_j, so the objective stays the seconds of re-runs and stalls (and the MIP gap is
    # relative to it).
    mu = p.mlp_seconds or [0.0] * n
    m.graph_saving = pyo.Expression(expr=qs(p.reruns[j] * m.held[j] for j in m.held)
                                    - qs(mu[j] * m.r[j] for j in m.r))
    m.reruns = pyo.Expression(expr=qs(p.reruns[j] * (1 - m.held[j]) for j in m.held)
                              + qs(mu[j] * m.r[j] for j in m.r))
    m.obj = pyo.Objective(expr=m.recompute + m.slack + m.ties + m.reruns, sense=pyo.minimize)
    m._edges, m._inner = edges, inner
    return m


def _status(tc: TerminationCondition) -> str:
    return {TerminationCondition.optimal: "optimal", TerminationCondition.maxTimeLimit: "time_limit",
            TerminationCondition.maxIterations: "iteration_limit",
            TerminationCondition.objectiveLimit: "objective_limit"}.get(tc, str(tc.name))


def solve(problem: ScheduleProblem, time_limit: float = 10.0, mip_gap: float = 0.01,
          threads: int | None = None, engine_windows: bool = False) -> Schedule:
    """Solve the full placement MILP; returns the best plan found within ``time_limit`` seconds / ``mip_gap``.

    Raises InfeasibleScheduleError when no plan fits the budgets (pre-check or solver), RuntimeError when HiGHS
    stops without any feasible plan for another reason (e.g. the time limit hit before the first incumbent).
    """
    precheck(problem)
    t0 = time.perf_counter()
    m = _build(problem, engine_windows)
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
            f"a spill dir", saved_boundaries=True)
    if res.best_feasible_objective is None:
        raise RuntimeError(f"HiGHS found no plan ({tc.name}) within {time_limit} s; raise the time limit")
    opt.load_vars()
    return _extract(problem, m, res, _status(tc), t_build, t_total)


def _val(v) -> float:
    x = pyo.value(v)
    return 0.0 if x is None else float(x)


def _extract(p: ScheduleProblem, m: pyo.ConcreteModel, res, status: str, t_build: float, t_total: float) -> Schedule:
    n = p.num_layers
    homes = ["recompute"] * (n + 1)
    homes[0] = homes[n] = "gpu"
    for i in m._inner:
        for name in ("g", "c", "n"):
            if _val(getattr(m, name)[i]) > 0.5:
                homes[i] = {"g": "gpu", "c": "cpu", "n": "nvme"}[name]
    obj = float(res.best_feasible_objective)
    bound = res.best_objective_bound
    gap = 0.0 if bound is None or obj == 0 else max(0.0, (obj - float(bound)) / abs(obj))
    mlp_recompute = [j in m.r and _val(m.r[j]) > 0.5 for j in range(n)]
    keep_graph = [(j in m.k and _val(m.k[j]) > 0.5) or mlp_recompute[j] for j in range(n)]
    graphs = held_graph_bytes(p, keep_graph, mlp_recompute)
    # Re-check the budgets in exact integer bytes: the solver works in GiB floats with a feasibility tolerance.
    for tier, budget in (("gpu", p.gpu_budget_bytes), ("cpu", p.cpu_budget_bytes), ("nvme", p.nvme_budget_bytes)):
        used = sum(b for b, t in zip(p.activation_bytes, homes, strict=True) if t == tier)
        used += graphs if tier == "gpu" else 0
        if used > budget:
            raise RuntimeError(f"solver plan puts {used} B on {tier} over its {budget} B budget (round-off); "
                               f"lower the {tier} budget by a few KiB")
    pieces = plan_gpu_pieces(p, homes, keep_graph, mlp_recompute)
    gpu_bytes = sum(pieces.values())
    if p.gpu_total_bytes is not None and gpu_bytes > p.gpu_total_bytes:
        raise RuntimeError(f"solver plan needs {gpu_bytes} B of GPU memory over the {p.gpu_total_bytes} B the "
                           f"device has for it (round-off); lower gpu_total_bytes by a few KiB")
    sched = Schedule(homes=homes, objective=obj, status=status, keep_graph=keep_graph,
                     max_recompute_span=p.max_recompute_span, mlp_recompute=mlp_recompute,
                     micro_batches=p.micro_batches)
    recompute = sum(p.recompute_seconds(s, e) for s, e in sched.blocks())
    slack = _val(m.slack)
    sched.predicted_exposed_seconds = recompute + slack
    sched.info = {"recompute_seconds": recompute, "slack_seconds": slack, "step_start_seconds": p.step_start_seconds,
                  "mip_gap": gap,
                  "best_bound": None if bound is None else float(bound), "build_seconds": round(t_build, 4),
                  "solve_seconds": round(t_total, 4),
                  "num_binaries": len(m._edges) + 3 * len(m._inner) + len(m.k) + len(m.r),
                  "kept_graph_seconds": _val(m.graph_saving), "gpu_bytes": gpu_bytes, "gpu_pieces": pieces}
    log.info("schedule solved: %s in %.2f s (gap %.4f), exposed %.4f s, homes %s", status, t_total, gap,
             sched.predicted_exposed_seconds, sched.counts())
    return sched
