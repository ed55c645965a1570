"""A given plan's exposed seconds under the engine's transfer rules (``milp_transfers.py``): its re-forwards
plus the transfer time it cannot hide.

For any plan (a solved one, an interval plan, a JSON plan, the one a run used), the homes and blocks are fixed
and only the transfers are placed, as well as the link and disk allow (an LP). Budgets are not checked here: this
is a time estimate, not admission.
"""

from __future__ import annotations

from dataclasses import replace

import pyomo.environ as pyo
from pyomo.contrib.appsi.base import TerminationCondition
from pyomo.contrib.appsi.solvers import Highs

from .milp import _build
from .problem import ScheduleProblem

_HOME_VARS = {"gpu": "g", "cpu": "c", "nvme": "n"}


def predicted_exposure(problem: ScheduleProblem, homes: list[str], keep_graph: list[bool] | None = None,
                       mlp_recompute: list[bool] | None = None) -> dict:
    """``{"recompute_seconds", "slack_seconds", "exposed_seconds"}`` of the plan ``homes`` (one home per boundary,
    as ``Schedule.homes``) with ``keep_graph`` and ``mlp_recompute`` per layer (default none kept)."""
    n = problem.num_layers
    if len(homes) != n + 1 or homes[0] == "recompute" or homes[n] == "recompute":
        raise ValueError(f"a plan for {n} layers needs {n + 1} homes with boundaries 0 and L kept, got {homes}")
    keep = list(keep_graph or [False] * n)
    partial = list(mlp_recompute or [False] * n)
    saved = [i for i, t in enumerate(homes) if t != "recompute"]
    blocks = set(zip(saved[:-1], saved[1:]))
    longest = max(e - s for s, e in blocks)
    big = 1 << 62
    p = replace(problem, gpu_budget_bytes=big, cpu_budget_bytes=big, nvme_budget_bytes=big, gpu_total_bytes=None,
                max_recompute_span=max(problem.max_recompute_span, longest),
                keep_graph_layers=[j for j in range(n) if keep[j] and not partial[j]])
    if any(keep[j] and not p.may_keep_graph(j) for j in range(n)):
        p = replace(p, graph_bytes=[0] * n)
    if any(partial) and p.mlp_graph_bytes is None:  # the transfer rows read only which layers hold a graph
        p = replace(p, mlp_graph_bytes=[0] * n, mlp_seconds=[0.0] * n)
    m = _build(p, engine_windows=True)
    for s, e in m._edges:
        m.x[s, e].fix(1 if (s, e) in blocks else 0)
    for i in m._inner:
        for home, name in _HOME_VARS.items():
            getattr(m, name)[i].fix(1 if homes[i] == home else 0)
    for j in m.k:
        m.k[j].fix(1 if keep[j] and not partial[j] else 0)
    for j in m.r:
        m.r[j].fix(1 if partial[j] else 0)
    opt = Highs()
    opt.config.stream_solver = False
    res = opt.solve(m)
    if res.termination_condition != TerminationCondition.optimal:
        raise RuntimeError(f"the transfer LP of plan {homes} ended {res.termination_condition.name}")
    recompute = sum(problem.recompute_seconds(s, e) for s, e in blocks)
    slack = float(pyo.value(m.slack))
    return {"recompute_seconds": recompute, "slack_seconds": slack, "exposed_seconds": recompute + slack}
