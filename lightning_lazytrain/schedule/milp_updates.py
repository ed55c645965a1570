"""Update placement as an MILP: per streamed unit, its optimizer update on the CPU worker or the device worker.

Time 0 is the end of the backward (with clipping no update starts before the global norm is known). Units
``u = 0..U-1`` in the order the next forward needs them; each worker runs its units in that order, one at a time:
the CPU worker takes ``cpu_seconds[u]``, the device worker ``device_seconds[u]`` (its copies in and out). The next
forward runs unit u for ``forward_seconds[u]`` once it is updated and unit u-1 has run. Model, binary ``y_u`` (1:
device) and forward starts ``s_u >= 0``:

* ``s_u >= s_{u-1} + f_{u-1}``;
* ``s_u >= sum_{v<=u} c_v (1 - y_v) - C_u y_u`` (on the CPU: the CPU worker's finish of u; ``C_u = sum_{v<=u}
  c_v``, so the row is void where y_u = 1), and ``s_u >= sum_{v<=u} d_v y_v - D_u (1 - y_u)`` likewise;
* optionally ``sum device_bytes[u] y_u <= device_budget_bytes`` (kept gradients on the GPU).

Objective: the forward's wait, ``s_{U-1} + f_{U-1} - sum f``, plus a tie-breaker of 1e-6 s per device-second
that prefers the CPU (fewer copies on the link the forward's weights use) where the wait is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyomo.environ as pyo
from pyomo.contrib.appsi.base import TerminationCondition
from pyomo.contrib.appsi.solvers import Highs

TIE = 1e-6


@dataclass
class UpdateProblem:
    """Per unit, in forward order: seconds of its update on the CPU worker and on the device worker, seconds of its
    next forward; optionally the device bytes a device update holds and their budget."""

    cpu_seconds: list[float]
    device_seconds: list[float]
    forward_seconds: list[float]
    device_bytes: list[int] | None = None
    device_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        n = len(self.cpu_seconds)
        lists = {"device_seconds": self.device_seconds, "forward_seconds": self.forward_seconds}
        if self.device_bytes is not None:
            lists["device_bytes"] = self.device_bytes
        for name, values in {"cpu_seconds": self.cpu_seconds, **lists}.items():
            if len(values) != n:
                raise ValueError(f"UpdateProblem.{name} has {len(values)} entries, cpu_seconds has {n}: one per unit")
            if any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"UpdateProblem.{name} must be finite and >= 0, got {values}")


@dataclass
class UpdateSplit:
    on_device: list[bool]
    wait_seconds: float
    status: str
    gap: float


def forward_wait(p: UpdateProblem, on_device: list[bool]) -> float:
    """Seconds the next forward waits for updates under the split ``on_device`` (the timeline the MILP models)."""
    cpu = dev = start = 0.0
    for c, d, f, flag in zip(p.cpu_seconds, p.device_seconds, p.forward_seconds, on_device, strict=True):
        if flag:
            dev += d
        else:
            cpu += c
        start = max(start, dev if flag else cpu) + f
    return start - sum(p.forward_seconds)


def _build(p: UpdateProblem) -> pyo.ConcreteModel:
    n, qs = len(p.cpu_seconds), pyo.quicksum
    units = list(range(n))
    c_cum = [sum(p.cpu_seconds[: u + 1]) for u in units]
    d_cum = [sum(p.device_seconds[: u + 1]) for u in units]
    m = pyo.ConcreteModel()
    m.y = pyo.Var(units, domain=pyo.Binary)
    m.s = pyo.Var(units, domain=pyo.NonNegativeReals)
    m.order = pyo.Constraint(units[1:], rule=lambda m, u: m.s[u] >= m.s[u - 1] + p.forward_seconds[u - 1])
    m.cpu = pyo.Constraint(units, rule=lambda m, u: m.s[u] >= qs(p.cpu_seconds[v] * (1 - m.y[v])
                                                                  for v in range(u + 1)) - c_cum[u] * m.y[u])
    m.dev = pyo.Constraint(units, rule=lambda m, u: m.s[u] >= qs(p.device_seconds[v] * m.y[v]
                                                                  for v in range(u + 1)) - d_cum[u] * (1 - m.y[u]))
    if p.device_bytes is not None and p.device_budget_bytes is not None:
        m.budget = pyo.Constraint(expr=qs(b * m.y[u] for u, b in enumerate(p.device_bytes))
                                  <= p.device_budget_bytes)
    m.obj = pyo.Objective(expr=m.s[n - 1] + p.forward_seconds[-1] - sum(p.forward_seconds)
                          + TIE * qs(p.device_seconds[u] * m.y[u] for u in units), sense=pyo.minimize)
    return m


def solve_updates(p: UpdateProblem, time_limit: float = 10.0, mip_gap: float = 0.01,
                  threads: int | None = None) -> UpdateSplit:
    """The split with the least forward wait found within ``time_limit`` / ``mip_gap`` (all on the CPU when there
    is no unit or nothing beats it)."""
    if not p.cpu_seconds:
        return UpdateSplit([], 0.0, "optimal", 0.0)
    m = _build(p)
    opt = Highs()
    opt.config.load_solution = False
    opt.config.stream_solver = False
    opt.config.time_limit = float(time_limit)
    opt.config.mip_gap = float(mip_gap)
    if threads is not None:
        opt.highs_options = {"threads": int(threads)}
    res = opt.solve(m)
    if res.best_feasible_objective is None:
        raise RuntimeError(f"HiGHS found no update split ({res.termination_condition.name}) within {time_limit} s; "
                           "raise the time limit or the device update budget")
    opt.load_vars()
    flags = [pyo.value(m.y[u]) > 0.5 for u in range(len(p.cpu_seconds))]
    obj, bound = float(res.best_feasible_objective), res.best_objective_bound
    gap = 0.0 if bound is None or obj == 0 else max(0.0, (obj - float(bound)) / abs(obj))
    status = "optimal" if res.termination_condition == TerminationCondition.optimal else "time_limit"
    return UpdateSplit(flags, forward_wait(p, flags), status, gap)
