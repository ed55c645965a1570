"""The memory-aware placement problem the strategy solves at its first batch, built once for the run and the forecast.

`lightning_lazytrain.planning.solve.solve_plan` (the run, with the executor's numbers) and `forecast` (shapes only)
both build their problem here (through `plan_inputs.problem_for`), so the forecast plans as the run does: the
device memory the whole plan may use (`plan_total_bytes`), one weight slot's bytes, ``max(1, prefetch_depth)``
slots every plan holds, the head's working set, and the graphs of the last ``keep_graph_layers`` layers kept. The
MILP takes the slots, kept graphs and each block's working set out of the total (`milp_memory.py`); the GPU
activation budget is the user's, capped by it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from .build import build_problem
from .feasibility import plan_exists
from .layer_memory import micro_batch_working_bytes
from .problem import ScheduleProblem
from .profile import Profile

#: The share of the device memory free for the plan that it may fill; the rest absorbs the caching allocator's
#: rounding and fragmentation.
PLAN_MEMORY_MARGIN = 0.95


def plan_total_bytes(available_bytes: int) -> int:
    """Device bytes the plan may use when ``available_bytes`` are free for it (slots, boundaries, graphs, peaks)."""
    return int(max(0, available_bytes) * PLAN_MEMORY_MARGIN)


def head_working_bytes(loss_chunk_bytes: int, last_boundary_bytes: int, head_grad_bytes: int) -> int:
    """The head's working set: a logits chunk, its gradient and softmax, the hidden state and its gradient, and
    the fp32 sum of the head's weight gradient over the chunks (``head_grad_sum_bytes``)."""
    return 3 * loss_chunk_bytes + 2 * last_boundary_bytes + head_grad_bytes


def head_grad_sum_bytes(lm_head: torch.nn.Module) -> int:
    """Bytes of the fp32 weight-gradient sum the chunked loss keeps from the head's forward to its backward
    (vocabulary x hidden x 4: 2.2 GB at Qwen2.5-7B); 0 for a frozen head."""
    weight = lm_head.weight
    return 4 * weight.numel() if weight.requires_grad else 0


def run_micro_batches(schedule: str, layer_micro_batches: int | Literal["auto"]) -> int | Literal["auto"]:
    """The slices a run's layers take: only the MILP chooses them, so ``"auto"`` is 1 for an interval or JSON
    plan (the strategy's and the forecast's rule)."""
    return 1 if layer_micro_batches == "auto" and schedule.strip() != "milp" else layer_micro_batches


def micro_batch_candidates(rows: int) -> list[int]:
    """1, 2, 4, ... below ``rows``, then ``rows`` (one row a slice); [1] when the batch is not known."""
    out = [1]
    while out[-1] * 2 < rows:
        out.append(out[-1] * 2)
    return out + [rows] if rows > 1 else out


def plan_problem(
    profile: Profile,
    gpu_budget_bytes: int,
    cpu_budget_bytes: int,
    nvme_budget_bytes: int,
    *,
    total_bytes: int | None,
    slot_bytes: int,
    prefetch_depth: int,
    loss_chunk_bytes: int,
    head_grad_bytes: int,
    max_recompute_span: int,
    keep_graph_layers: int,
    micro_batches: int | Literal["auto"] = 1,
) -> ScheduleProblem:
    """The problem for ``profile`` under the activation budgets and the device's ``total_bytes`` (``None``: no
    device memory limits the plan, the CPU run); the last ``keep_graph_layers`` layers must keep their graph;
    layers run in ``micro_batches`` row slices (their working set as `micro_batch_working_bytes`, their times and
    every other byte count as profiled for the whole batch).

    ``micro_batches="auto"``: the fewest slices, of 1, 2, 4, ... and one row each, for which some plan meets the
    memory rows (`feasibility.plan_exists`); the most when none does, so that the solve's refusal is the one left
    after slicing. Fewest, since a slice below the GPU's efficient size runs slower."""
    if micro_batches == "auto":
        problem = None
        # without a working set to divide, slices change nothing and only run slower
        for slices in micro_batch_candidates(profile.batch if profile.working_bytes else 1):
            problem = plan_problem(profile, gpu_budget_bytes, cpu_budget_bytes, nvme_budget_bytes,
                                   total_bytes=total_bytes, slot_bytes=slot_bytes, prefetch_depth=prefetch_depth,
                                   loss_chunk_bytes=loss_chunk_bytes, head_grad_bytes=head_grad_bytes,
                                   max_recompute_span=max_recompute_span, keep_graph_layers=keep_graph_layers,
                                   micro_batches=slices)
            if total_bytes is None or plan_exists(problem):
                break
        assert problem is not None
        return problem
    n = profile.num_layers
    slices = min(micro_batches, profile.batch) if profile.batch else micro_batches  # the engine's, never empty
    if slices > 1 and profile.working_bytes:
        profile = dataclasses.replace(profile, working_bytes=[
            micro_batch_working_bytes(w, b, a, slices)
            for w, b, a in zip(profile.working_bytes, profile.gradients, profile.activation_bytes)])
    if keep_graph_layers > n:
        raise ValueError(f"keep_graph_layers={keep_graph_layers} is more than the model's {n} layers")
    gpu = gpu_budget_bytes if total_bytes is None else min(gpu_budget_bytes, total_bytes)
    return build_problem(
        profile,
        gpu,
        cpu_budget_bytes,
        nvme_budget_bytes,
        max_recompute_span=max_recompute_span,
        keep_graph_layers=list(range(n - keep_graph_layers, n)),
        gpu_total_bytes=total_bytes,
        slot_bytes=slot_bytes,
        fixed_slots=max(1, prefetch_depth),
        head_working_bytes=head_working_bytes(loss_chunk_bytes, profile.activation_bytes[-1], head_grad_bytes),
        micro_batches=slices,
    )
