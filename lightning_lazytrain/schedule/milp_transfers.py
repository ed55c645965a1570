"""The link and disk side of the placement MILP: when each offload and reload can run, and what it costs.

The rules follow what the engine does (``engine/compute/stack.py``, ``engine/activations/homes.py``), not a looser
model, so that a plan the solver calls hidden is hidden when it runs:

* A step is the forward of layers 0..L-1, the head (window L), then the backward blocks from the top. Window w
  has a forward part (``forward_seconds[w]``) and a backward part (``window_seconds[w] - forward_seconds[w]``; a
  layer that keeps its graph runs no re-run there, so one ``rerun_seconds[w]`` less).
* Offload of boundary i: during the forward of layers i..L-1, on the D2H link (nothing else uses it in the
  forward: gradients go back in the backward). A CPU offload may also run during the head; an NVMe one may not,
  since the forward waits for every spill write before the head starts (``ActivationHomes.flush``). NVMe bytes
  also use the disk's write speed in the same forward part.
* Reload of boundary i, the start of block (i, e): the engine starts it when the nearest block above it that
  reads its own input back starts (a layer holding a graph from the forward reads none back), and needs it when
  the block right above, (e, f), is done. So it runs in the backward parts of the blocks from e up to that one;
  where every block above holds a graph (or e = L), in those and the head, where the forward's end starts it. It
  shares the H2D link with the backward's weight copy (half of ``param_h2d_bytes[w]``; none for a kept graph).
  NVMe bytes also use the disk's read speed there.
  Linear form, for window w with i < w <= L (L: the head): ``h(i,w) <= A_i * sum_{e<=w} x(i,e)`` (the block from
  i ends at or before w) and ``h(i,w) <= A_i * a(i,w)`` with ``0 <= a(i,w) <= 1 - z_w + x(i,w) + held_{w-1}``
  (``z_L = 1``) and ``a(i,w) <= a(i,w-1) + x(i,w)``: a drops to 0 at the first saved boundary after i's
  successor that does not end a held layer's block, and stays there. Windows past ``i + 2 * span - 1 + K`` can
  never hold the reload and get no variable, K being the most layers that can hold a graph at once (`most_held`).
* Per part and direction: bytes <= max(0, seconds * bandwidth - mandatory) + slack; the slack is charged at
  1 / bandwidth seconds per byte. PCIe and disk slack of one part are added (an upper estimate).
"""

from __future__ import annotations

import pyomo.environ as pyo

from .problem import GIB, ScheduleProblem


def _cap(m: pyo.ConcreteModel, base: list[float], kept: list[float], w: int):
    """Capacity of part w, lowered where layer w holds a graph from the forward (``m.held``)."""
    return base[w] + (kept[w] - base[w]) * m.held[w] if w in m.held else base[w]


def most_held(p: ScheduleProblem, held: list[int]) -> int:
    """The most layers of ``held`` that can hold a graph at once: each takes at least its smaller graph and (inside)
    its input boundary out of the GPU activation budget, beside boundaries 0 and L."""
    a, n = p.activation_bytes, p.num_layers
    whole, part = p.graph_bytes or [0] * n, p.mlp_graph_bytes or [0] * n

    def least(j: int) -> int:
        graphs = ([whole[j]] if p.may_keep_graph(j) else []) + ([part[j]] if p.may_recompute_mlp(j) else [])
        return min(graphs) + (a[j] if 0 < j < n else 0)

    costs = sorted(least(j) for j in held)
    room, count = p.gpu_budget_bytes - a[0] - a[n], 0
    while count < len(costs) and costs[count] <= room:
        room -= costs[count]
        count += 1
    return count


def add_transfers(m: pyo.ConcreteModel, p: ScheduleProblem, a: list[float], inner: list[int],
                  out_e: dict[int, list[int]]) -> None:
    """Add the transfer variables, their windows, the per-part capacities and ``m.slack`` (seconds) to ``m``."""
    n, span, qs = p.num_layers, p.max_recompute_span, pyo.quicksum
    head = p.head_seconds
    fwd = list(p.forward_seconds) + [head]
    bwd = [max(0.0, p.window_seconds[w] - p.forward_seconds[w]) for w in range(n)] + [head]
    bwd_kept = [max(0.0, bwd[w] - p.reruns[w]) for w in range(n)] + [head]
    h2d_bwd = [b / 2 for b in p.param_h2d_bytes] + [0]
    wins = list(range(n + 1))  # n = the head
    free_d = [fwd[w] * p.d2h_bytes_per_s / GIB for w in wins]
    cap_w = [fwd[w] * p.nvme_write_bytes_per_s / GIB if w < n else 0.0 for w in wins]
    free_h = [max(0.0, bwd[w] * p.h2d_bytes_per_s - h2d_bwd[w]) / GIB for w in wins]
    kfree_h = [bwd_kept[w] * p.h2d_bytes_per_s / GIB for w in wins]
    cap_r = [bwd[w] * p.nvme_read_bytes_per_s / GIB for w in wins]
    kcap_r = [bwd_kept[w] * p.nvme_read_bytes_per_s / GIB for w in wins]

    moving = [i for i in inner if a[i] > 0]  # zero-byte boundaries never move: no variables
    off_idx = [(i, w) for i in moving for w in range(i, n + 1)]
    # the successor block ends by i + 2 span - 1; each layer holding a graph in between reaches one window further
    far = min(n, 2 * span + most_held(p, list(m.held)))
    rel_idx = [(i, w) for i in moving for w in [*range(i + 1, min(n, i + far)), n]]
    m.dc = pyo.Var(off_idx, domain=pyo.NonNegativeReals)
    m.dn = pyo.Var([(i, w) for i, w in off_idx if w < n], domain=pyo.NonNegativeReals)
    m.hc = pyo.Var(rel_idx, domain=pyo.NonNegativeReals)
    m.hn = pyo.Var(rel_idx, domain=pyo.NonNegativeReals)
    for name in ("sD", "sH", "sW", "sR"):
        setattr(m, name, pyo.Var(wins, domain=pyo.NonNegativeReals))
    off_w = {i: [w for j, w in off_idx if j == i] for i in moving}
    rel_w = {i: [w for j, w in rel_idx if j == i] for i in moving}
    by_w_off = {w: [i for i in moving if i <= w] for w in wins}
    by_w_rel = {w: [i for i, v in rel_idx if v == w] for w in wins}

    def dn(i: int, w: int):
        return m.dn[i, w] if w < n else 0

    m.off_c = pyo.Constraint(moving, rule=lambda m, i: qs(m.dc[i, w] for w in off_w[i]) == a[i] * m.c[i])
    m.off_n = pyo.Constraint(moving, rule=lambda m, i: qs(dn(i, w) for w in off_w[i]) == a[i] * m.n[i])
    m.rel_c = pyo.Constraint(moving, rule=lambda m, i: qs(m.hc[i, w] for w in rel_w[i]) == a[i] * m.c[i])
    m.rel_n = pyo.Constraint(moving, rule=lambda m, i: qs(m.hn[i, w] for w in rel_w[i]) == a[i] * m.n[i])

    def z(b: int):
        return m.g[b] + m.c[b] + m.n[b] if b < n else 1

    def x(i: int, b: int):
        return m.x[i, b] if b in out_e[i] else 0

    def held(j: int):
        return m.held[j] if j in m.held else 0

    def before(i: int, w: int):
        """a(i, w - 1), 0 where w - 1 has no variable (past the reach, or boundary i itself)."""
        return m.a[i, w - 1] if (i, w - 1) in m.a else 0

    m.rel_after = pyo.Constraint(rel_idx, rule=lambda m, i, w: m.hc[i, w] + m.hn[i, w]
                                 <= a[i] * qs(m.x[i, e] for e in out_e[i] if e <= w))
    # a(i, w) <= 1 while every boundary saved after i's successor, up to w, ends a held layer's block (reset where
    # w is the successor)
    m.a = pyo.Var(rel_idx, bounds=(0, 1))
    m.a_new = pyo.Constraint(rel_idx, rule=lambda m, i, w: m.a[i, w] <= 1 - z(w) + x(i, w) + held(w - 1))
    m.a_carry = pyo.Constraint([(i, w) for i, w in rel_idx if w > i + 1],
                               rule=lambda m, i, w: m.a[i, w] <= before(i, w) + x(i, w))
    m.rel_block = pyo.Constraint(rel_idx, rule=lambda m, i, w: m.hc[i, w] + m.hn[i, w] <= a[i] * m.a[i, w])
    m.capD = pyo.Constraint(wins, rule=lambda m, w: qs(m.dc[i, w] + dn(i, w) for i in by_w_off[w])
                            <= free_d[w] + m.sD[w])
    m.capW = pyo.Constraint(wins, rule=lambda m, w: qs(dn(i, w) for i in by_w_off[w]) <= cap_w[w] + m.sW[w])
    m.capH = pyo.Constraint(wins, rule=lambda m, w: qs(m.hc[i, w] + m.hn[i, w] for i in by_w_rel[w])
                            <= _cap(m, free_h, kfree_h, w) + m.sH[w])
    m.capR = pyo.Constraint(wins, rule=lambda m, w: qs(m.hn[i, w] for i in by_w_rel[w])
                            <= _cap(m, cap_r, kcap_r, w) + m.sR[w])
    m.slack = pyo.Expression(expr=qs(
        m.sD[w] * (GIB / p.d2h_bytes_per_s) + m.sH[w] * (GIB / p.h2d_bytes_per_s)
        + m.sW[w] * (GIB / p.nvme_write_bytes_per_s) + m.sR[w] * (GIB / p.nvme_read_bytes_per_s) for w in wins))
