"""The GPU-memory side of the placement MILP: kept graphs, weight slots and the per-layer working set.

Per layer j a binary ``k_j`` (offered where ``ScheduleProblem.may_keep_graph(j)``): layer j keeps its autograd graph
from the forward, so its backward runs without a re-forward. It needs block (j, j+1) (``k_j <= x(j, j+1)``) and its
input boundary on the GPU (the graph holds it: ``k_j <= g_j``); it holds ``graph_bytes[j]`` and one weight slot
until its backward; it saves its re-run, ``rerun_seconds[j]`` of compute (objective ``+ rho'_j (1 - k_j)``), and
shrinks window j by that time and by one of the two weight copies of ``param_h2d_bytes[j]`` (the capacity terms of
``milp.py``).

A second binary ``r_j`` (offered where ``may_recompute_mlp(j)``): layer j keeps its graph but re-runs its MLP in
the backward (``Schedule.mlp_recompute``). It is exclusive with ``k_j`` (``k_j + r_j <= x(j, j+1)``), needs its
input on the GPU like ``k_j``, holds ``mlp_graph_bytes[j]`` and one slot, and costs ``mlp_seconds[j]`` in the
objective instead of ``rerun_seconds[j]``. ``m.held[j] = k_j + r_j`` (the layer holds weights and a graph from
the forward) is what the transfer rows read: they give an ``r_j`` layer a kept layer's window, one
``mlp_seconds[j]`` short of what it computes, a lower estimate of the time transfers can hide in.

GPU bytes, two rows:

* ``A_0 + A_L + sum A_i g_i + sum G_j k_j <= gpu_budget_bytes`` (what the user's activation budget caps);
* with ``gpu_total_bytes``: that sum ``+ sum slot k_j + fixed_slots * slot + peak <= gpu_total_bytes``, where
  ``peak >= block_peak_bytes(s, e) * x(s, e)`` for every edge and ``peak >= head_peak_bytes``: the largest
  block's slots, rebuilt boundaries and working set (the engine sizes its slot pool by the largest block too).
  Every kept graph and saved boundary is counted for the whole step, an upper estimate: a graph is freed when its
  backward ran, before lower blocks reach their peak.
"""

from __future__ import annotations

import pyomo.environ as pyo

from .problem import GIB, ScheduleProblem


def add_memory(
    m: pyo.ConcreteModel, p: ScheduleProblem, a: list[float], inner: list[int], edges: list[tuple[int, int]]
) -> None:
    """Add ``m.k``, ``m.r``, ``m.held`` and the GPU budget rows to the model ``m`` (``a``: boundary GiB)."""
    n, qs = p.num_layers, pyo.quicksum
    keep = [j for j in range(n) if p.may_keep_graph(j)]
    part = [j for j in range(n) if p.may_recompute_mlp(j)]
    held = sorted(set(keep) | set(part))
    graph = [(p.graph_bytes[j] if p.graph_bytes is not None else 0) / GIB for j in range(n)]
    partial = [(p.mlp_graph_bytes[j] if p.mlp_graph_bytes is not None else 0) / GIB for j in range(n)]
    slot = p.slot_bytes / GIB
    m.k = pyo.Var(keep, domain=pyo.Binary)
    m.r = pyo.Var(part, domain=pyo.Binary)
    m.held = pyo.Expression(held, rule=lambda m, j: (m.k[j] if j in keep else 0) + (m.r[j] if j in part else 0))
    m.k_edge = pyo.Constraint(held, rule=lambda m, j: m.held[j] <= m.x[j, j + 1])
    m.k_gpu = pyo.Constraint([j for j in held if j in inner], rule=lambda m, j: m.held[j] <= m.g[j])
    m.k_forced = pyo.Constraint(p.keep_graph_layers, rule=lambda m, j: m.k[j] == 1)
    saved = qs(a[i] * m.g[i] for i in inner) + qs(graph[j] * m.k[j] for j in keep)
    saved += qs(partial[j] * m.r[j] for j in part)
    if inner or held:
        m.bud_g = pyo.Constraint(expr=saved <= p.gpu_budget_bytes / GIB - a[0] - a[n])
    if p.gpu_total_bytes is None:
        return
    m.peak = pyo.Var(domain=pyo.NonNegativeReals, bounds=(p.head_peak_bytes / GIB, None))
    m.peak_edge = pyo.Constraint(edges, rule=lambda m, s, e: m.peak >= p.block_peak_bytes(s, e) / GIB * m.x[s, e])
    m.bud_total = pyo.Constraint(
        expr=a[0] + a[n] + saved + qs(slot * m.held[j] for j in held) + p.fixed_slots * slot + m.peak
        <= p.gpu_total_bytes / GIB
    )


def held_graph_bytes(p: ScheduleProblem, keep_graph: list[bool], mlp_recompute: list[bool] | None = None) -> int:
    """Bytes of the graphs a plan keeps: whole ones, and those whose MLP re-runs (``mlp_recompute``)."""
    partial = mlp_recompute or [False] * p.num_layers
    whole = p.graph_bytes or [0] * p.num_layers
    part = p.mlp_graph_bytes or [0] * p.num_layers
    return sum((part if r else whole)[j] for j, (k, r) in enumerate(zip(keep_graph, partial, strict=True)) if k)


def plan_gpu_pieces(p: ScheduleProblem, homes: list[str], keep_graph: list[bool],
                    mlp_recompute: list[bool] | None = None) -> dict[str, int]:
    """The GPU bytes the rows above charge a plan, by piece: its GPU-homed boundaries (0 and L included), kept
    graphs, the slots held through the step (prefetch and kept graphs) and the peak (the largest block's slots,
    rebuilt boundaries and working set, or the head's working set)."""
    saved = [i for i, t in enumerate(homes) if t != "recompute"]
    return {
        "boundaries": sum(b for b, t in zip(p.activation_bytes, homes, strict=True) if t == "gpu"),
        "graphs": held_graph_bytes(p, keep_graph, mlp_recompute),
        "slots": p.slot_bytes * (p.fixed_slots + sum(keep_graph)),
        "peak": max([p.head_peak_bytes] + [p.block_peak_bytes(s, e) for s, e in zip(saved[:-1], saved[1:])]),
    }


def plan_gpu_bytes(p: ScheduleProblem, homes: list[str], keep_graph: list[bool],
                   mlp_recompute: list[bool] | None = None) -> int:
    """The GPU bytes the rows above charge a plan (`plan_gpu_pieces` summed)."""
    return sum(plan_gpu_pieces(p, homes, keep_graph, mlp_recompute).values())


def memory_shortfall(p: ScheduleProblem) -> str | None:
    """Why no plan can fit the device memory, or None: the ends, the forced graphs, the prefetch slots and the
    largest single layer's working set must fit ``gpu_total_bytes`` whatever the plan."""
    if p.gpu_total_bytes is None:
        return None
    a, n = p.activation_bytes, p.num_layers
    forced = sum((p.graph_bytes[j] if p.graph_bytes is not None else 0) + p.slot_bytes for j in p.keep_graph_layers)
    work = max([p.head_peak_bytes] + [p.block_peak_bytes(j, j + 1) for j in range(n)])
    need = a[0] + a[n] + forced + p.fixed_slots * p.slot_bytes + work
    if need <= p.gpu_total_bytes:
        return None
    sliced = f" in {p.micro_batches} row slices" if p.micro_batches > 1 else ""
    return (
        f"GPU memory short by {(need - p.gpu_total_bytes) / GIB:.3f} GiB: the smallest plan needs "
        f"{need / GIB:.3f} GiB (boundaries 0 and L {(a[0] + a[n]) / GIB:.3f}, {len(p.keep_graph_layers)} forced "
        f"kept graphs {forced / GIB:.3f}, {p.fixed_slots} prefetch slots "
        f"{p.fixed_slots * p.slot_bytes / GIB:.3f}, the largest layer's working set{sliced} with its slots and reloads "
        f"{work / GIB:.3f}) "
        f"and the device has {p.gpu_total_bytes / GIB:.3f} GiB for the plan; lower the batch / sequence length, "
        f"run each layer in more row slices (layer_micro_batches), keep fewer graphs (keep_graph_layers) or lower "
        f"prefetch_depth"
    )
