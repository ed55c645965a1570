"""The solver's default transfer rows: the paper's aggregated windows (LazyTrain Eq. 4-6), fast to solve.

Window w is layer w's forward and backward together (``window_seconds[w]``), window L the head. Offloads of
boundary i go in windows i..L, reloads in windows w >= e for its block (i, e), or the head; per window and
direction the bytes above ``max(0, W_w * bandwidth - mandatory)`` are slack, charged at 1 / bandwidth. This is
looser than what the engine runs (a reload starts with the nearest block above that reads its input back; spill
writes end with the forward), so it can call a plan hidden that stalls: ``milp_transfers.py`` has the engine's
rules, which `exposure.py` uses to predict a plan's stall and ``solve(engine_windows=True)`` solves with; they
solve slower (issue 16: the 27B 64-layer benchmark case ends at 8% gap in 10 s), so they are not the default yet.
"""

from __future__ import annotations

import pyomo.environ as pyo

from .problem import GIB, ScheduleProblem


def add_window_transfers(m: pyo.ConcreteModel, p: ScheduleProblem, a: list[float], inner: list[int],
                         out_e: dict[int, list[int]]) -> None:
    """Add the transfer variables, capacities and ``m.slack`` (seconds) of the aggregated-window model to ``m``."""
    n, qs = p.num_layers, pyo.quicksum
    wins = list(range(n + 1))  # n = head window
    secs = list(p.window_seconds) + [p.head_seconds]
    p_h2d = list(p.param_h2d_bytes) + [0]
    g_d2h = list(p.grad_d2h_bytes) + [0]
    free_d = [max(0.0, secs[w] * p.d2h_bytes_per_s - g_d2h[w]) / GIB for w in wins]
    free_h = [max(0.0, secs[w] * p.h2d_bytes_per_s - p_h2d[w]) / GIB for w in wins]
    cap_w = [secs[w] * p.nvme_write_bytes_per_s / GIB for w in wins]
    cap_r = [secs[w] * p.nvme_read_bytes_per_s / GIB for w in wins]
    # A layer that keeps its graph runs no forward-with-grad in its backward and needs one weight copy, not two.
    kept = [secs[w] - (p.reruns[w] if w < n else 0.0) for w in wins]
    kfree_d = [max(0.0, kept[w] * p.d2h_bytes_per_s - g_d2h[w]) / GIB for w in wins]
    kfree_h = [max(0.0, kept[w] * p.h2d_bytes_per_s - p_h2d[w] / 2) / GIB for w in wins]
    kcap_w = [kept[w] * p.nvme_write_bytes_per_s / GIB for w in wins]
    kcap_r = [kept[w] * p.nvme_read_bytes_per_s / GIB for w in wins]
    moving = [i for i in inner if a[i] > 0]  # zero-byte boundaries never move: no variables
    off_idx = [(i, w) for i in moving for w in range(i, n + 1)]
    rel_idx = [(i, w) for i in moving for w in range(i + 1, n + 1)]
    m.dc = pyo.Var(off_idx, domain=pyo.NonNegativeReals)
    m.dn = pyo.Var(off_idx, domain=pyo.NonNegativeReals)
    m.hc = pyo.Var(rel_idx, domain=pyo.NonNegativeReals)
    m.hn = pyo.Var(rel_idx, domain=pyo.NonNegativeReals)
    for name in ("sD", "sH", "sW", "sR"):
        setattr(m, name, pyo.Var(wins, domain=pyo.NonNegativeReals))
    off_w = {i: range(i, n + 1) for i in moving}
    rel_w = {i: range(i + 1, n + 1) for i in moving}
    by_w_off = {w: [i for i in moving if i <= w] for w in wins}
    by_w_rel = {w: [i for i in moving if i < w] for w in wins}
    m.off_c = pyo.Constraint(moving, rule=lambda m, i: qs(m.dc[i, w] for w in off_w[i]) == a[i] * m.c[i])
    m.off_n = pyo.Constraint(moving, rule=lambda m, i: qs(m.dn[i, w] for w in off_w[i]) == a[i] * m.n[i])
    m.rel_c = pyo.Constraint(moving, rule=lambda m, i: qs(m.hc[i, w] for w in rel_w[i]) == a[i] * m.c[i])
    m.rel_n = pyo.Constraint(moving, rule=lambda m, i: qs(m.hn[i, w] for w in rel_w[i]) == a[i] * m.n[i])
    # Reload in real window w only once the block leaving i ends at or before w.
    link_idx = [(i, w) for (i, w) in rel_idx if w < n]
    m.link = pyo.Constraint(link_idx, rule=lambda m, i, w: m.hc[i, w] + m.hn[i, w]
                            <= a[i] * qs(m.x[i, e] for e in out_e[i] if e <= w))

    def cap(base: list[float], keep: list[float], w: int):
        return base[w] + (keep[w] - base[w]) * m.held[w] if w in m.held else base[w]

    m.capD = pyo.Constraint(wins, rule=lambda m, w: qs(m.dc[i, w] + m.dn[i, w] for i in by_w_off[w])
                            <= cap(free_d, kfree_d, w) + m.sD[w])
    m.capH = pyo.Constraint(wins, rule=lambda m, w: qs(m.hc[i, w] + m.hn[i, w] for i in by_w_rel[w])
                            <= cap(free_h, kfree_h, w) + m.sH[w])
    m.capW = pyo.Constraint(wins, rule=lambda m, w: qs(m.dn[i, w] for i in by_w_off[w])
                            <= cap(cap_w, kcap_w, w) + m.sW[w])
    m.capR = pyo.Constraint(wins, rule=lambda m, w: qs(m.hn[i, w] for i in by_w_rel[w])
                            <= cap(cap_r, kcap_r, w) + m.sR[w])
    m.slack = pyo.Expression(expr=qs(
        m.sD[w] * (GIB / p.d2h_bytes_per_s) + m.sH[w] * (GIB / p.h2d_bytes_per_s)
        + m.sW[w] * (GIB / p.nvme_write_bytes_per_s) + m.sR[w] * (GIB / p.nvme_read_bytes_per_s) for w in wins))
