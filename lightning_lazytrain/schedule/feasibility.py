"""Whether any plan can meet a problem's memory rows, without solving the MILP: the batch search's test and the
layer micro-batch choice (``layer_micro_batches="auto"``) both ask it, so the batch `lazytrain plan` settles on is
one the strategy runs in the same slices."""

from __future__ import annotations

from .milp import InfeasibleScheduleError, precheck
from .problem import ScheduleProblem


def plan_exists(problem: ScheduleProblem) -> bool:
    """``precheck``'s necessary conditions and then `some_plan_fits`."""
    try:
        precheck(problem)
    except InfeasibleScheduleError:
        return False
    return some_plan_fits(problem)


def some_plan_fits(p: ScheduleProblem) -> bool:
    """Whether some plan meets the MILP's budget rows, for equal boundaries (the profiles of uniform models; other
    problems pass, and the MILP decides).

    A plan whose longest free block has ``k`` layers peaks at most at ``k`` slots (and the one copying out),
    ``k - 1`` rebuilt boundaries, the largest working set and ``reload_bytes``, and saves at least
    ``ceil(m / k) - 1`` boundaries inside each run of ``m`` layers
    between forced graphs; those go to whatever home still has room for a whole boundary. A forced graph holds its
    graph, a slot and its input boundary on the GPU; its output boundary is saved in some home. Exact when the
    layers' working sets are equal too; otherwise it may refuse a batch the MILP would take (never the reverse)."""
    a = p.activation_bytes
    if len(set(a)) != 1 or a[0] == 0:
        return True
    size, n = a[0], p.num_layers
    forced = set(p.keep_graph_layers)
    on_gpu = {j for j in forced if 0 < j < n}
    saved = sorted({0, n} | on_gpu | {j + 1 for j in forced})
    runs = [e - s for s, e in zip(saved[:-1], saved[1:]) if s not in forced]
    loose = len({j + 1 for j in forced if j + 1 < n} - on_gpu)  # forced outputs homed anywhere
    work = max(p.working_bytes) if p.working_bytes is not None else 0
    graphs = sum(p.graph_bytes[j] for j in forced) if p.graph_bytes is not None else 0
    held = 2 * size + len(on_gpu) * size + graphs
    forced_peaks = [p.block_peak_bytes(j, j + 1) for j in forced]
    for k in range(1, p.max_recompute_span + 1):
        longest = min(k, max(runs, default=0))
        block = (longest + 1) * p.slot_bytes + (longest - 1) * size + work + p.reload_bytes if longest else 0
        room = p.gpu_budget_bytes - held
        if p.gpu_total_bytes is not None:
            peak = max([p.head_peak_bytes, block, *forced_peaks])
            slots = (p.fixed_slots + len(forced)) * p.slot_bytes
            room = min(room, p.gpu_total_bytes - held - slots - peak)
        if room < 0:
            continue
        need = sum(-(-m // k) - 1 for m in runs) + loose
        if room // size + p.cpu_budget_bytes // size + p.nvme_budget_bytes // size >= need:
            return True
    return False
