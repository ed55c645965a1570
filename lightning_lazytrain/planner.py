"""From the ``schedule=`` argument to a ``Schedule``: a fixed interval, a JSON plan, or the MILP solved here.

The MILP needs the batch shape, so ``"milp"`` is solved at the first training batch: profile the layers (cached per
machine and shape), build the problem with the budgets, solve with HiGHS, write the plan as JSON beside the logs.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Literal

import psutil

from lightning_lazytrain.engine import Schedule, StreamingExecutor
from lightning_lazytrain.engine.device import device_free_bytes
from lightning_lazytrain.schedule import InfeasibleScheduleError, Profile, profile_model, solve
from lightning_lazytrain.schedule.plan_problem import (
    head_grad_sum_bytes,
    plan_problem,
    plan_total_bytes,
    run_micro_batches,
)
from lightning_lazytrain.units import GIB

log = logging.getLogger(__name__)


@dataclass
class PlanSettings:
    schedule: str = "interval:1"
    keep_graph_layers: int = 0
    gpu_activation_gib: float | None = None
    cpu_activation_gib: float | None = None
    nvme_activation_gib: float | None = None
    spill_dir: str | None = None
    max_recompute_span: int = 4
    solver_time_limit: float = 10.0
    solver_mip_gap: float = 0.01
    layer_micro_batches: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        self.kind()  # a schedule string that is not understood fails when the strategy is made
        k = self.layer_micro_batches
        if k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"layer_micro_batches={k!r}: use an integer >= 1 (each layer runs the batch in that "
                             "many row slices) or 'auto' (the MILP takes the fewest with which a plan fits)")

    def kind(self) -> str:
        if re.fullmatch(r"interval:\d+", self.schedule.strip()):
            return "interval"
        if self.schedule == "milp":
            return "milp"
        if self.schedule.endswith(".json"):
            return "json"
        raise ValueError(
            f"schedule={self.schedule!r} is not understood; use 'interval:K' (K >= 1), 'milp', or a path to a plan"
            " JSON written by lightning_lazytrain.engine.Schedule.to_json()"
        )


def initial_plan(settings: PlanSettings, num_layers: int) -> Schedule:
    """The plan to start with: final for interval and JSON plans, a placeholder until the MILP is solved."""
    kind = settings.kind()
    if kind == "interval":
        k = int(settings.schedule.split(":")[1])
        if k < 1:
            raise ValueError(f"schedule={settings.schedule!r}: the interval must be >= 1")
        plan = Schedule.every(num_layers, k, settings.keep_graph_layers)
        plan.micro_batches = run_micro_batches(settings.schedule, settings.layer_micro_batches)
        return plan
    if kind == "json":
        if settings.keep_graph_layers:
            raise ValueError(f"keep_graph_layers={settings.keep_graph_layers} does not apply to the plan file "
                             f"{settings.schedule}: its 'keep_graph' list says which layers keep their graph; set it "
                             "there, or drop keep_graph_layers")
        if settings.layer_micro_batches not in (1, "auto"):
            raise ValueError(f"layer_micro_batches={settings.layer_micro_batches} does not apply to the plan file "
                             f"{settings.schedule}: set its 'micro_batches' there, or drop layer_micro_batches")
        with open(settings.schedule) as f:
            schedule = Schedule.from_json(f.read())
        if schedule.num_layers != num_layers:
            raise ValueError(f"the plan in {settings.schedule} is for {schedule.num_layers} layers, the model has"
                             f" {num_layers}")
        return schedule
    return Schedule.every(num_layers, 1, 0)


def solve_plan(settings: PlanSettings, executor: StreamingExecutor, batch: int, seq: int,
               profile: Profile | None = None) -> Schedule:
    """Profile (unless ``profile`` is given: a re-plan), build and solve the MILP for this batch shape here."""
    if profile is None:
        with executor.unhooked():
            profile = profile_model(executor.adapter, batch, seq, executor.device, executor.store.stream_dtype,
                                    spill_dir=settings.spill_dir)
    gpu, cpu, nvme = budgets(settings, executor)
    total = gpu_total_bytes(executor)
    problem = plan_problem(profile, gpu, cpu, nvme, total_bytes=total,
                           slot_bytes=executor.slot_numel * executor.store.stream_dtype.itemsize,
                           prefetch_depth=executor.prefetch_depth, loss_chunk_bytes=executor.loss_chunk_bytes,
                           head_grad_bytes=head_grad_sum_bytes(executor.adapter.lm_head),
                           max_recompute_span=settings.max_recompute_span,
                           keep_graph_layers=settings.keep_graph_layers,
                           micro_batches=settings.layer_micro_batches)
    try:
        schedule = solve(problem, time_limit=settings.solver_time_limit, mip_gap=settings.solver_mip_gap)
    except InfeasibleScheduleError as exc:
        notes = []
        if exc.saved_boundaries and settings.cpu_activation_gib is None:
            notes.append(f"The CPU budget, {cpu / GIB:.3f} GiB, is a quarter of the {cpu / GIB * 4:.1f} GiB of host "
                         "RAM available at this batch: cpu_activation_gib sets it")
        held = executor.device_update_held_bytes + executor.device_update_reserve_bytes
        if total is not None and held:
            notes.append(f"Of the device memory, {held / GIB:.3f} GiB is held for the GPU's share of the optimizer "
                         f"update ({executor.device_update_held_bytes / GIB:.3f} GiB of masters and states kept or "
                         "staged there): device_update_states='staged', a lower device_update_share, or "
                         "device_update_share=0.0 leaves it to the plan")
        if not notes:
            raise
        raise InfeasibleScheduleError(". ".join([str(exc), *notes]), exc.saved_boundaries) from exc
    schedule.profile = profile  # what it was solved for: a re-plan starts from it
    log.info("lazytrain plan: %s, predicted exposed %.3f s", schedule.counts(), schedule.predicted_exposed_seconds)
    return schedule


def gpu_total_bytes(executor: StreamingExecutor) -> int | None:
    """Device bytes the whole plan may use (its slots, saved boundaries, graphs and working set): what is free now
    plus the slot pool it replaces, less what device-side updates hold, less the allocator's margin
    (`plan_total_bytes`). ``None`` off CUDA, where no device memory limits the plan."""
    if executor.device.type != "cuda":
        return None
    # no pool after a failed step was discarded (the OOM ladder re-plans then): its memory is already free
    slots = len(executor.pool.slots) if executor.pool is not None else 0
    pool = slots * executor.slot_numel * executor.store.stream_dtype.itemsize
    return plan_total_bytes(device_free_bytes(executor.device) + pool - executor.device_update_reserve_bytes)


def budgets(settings: PlanSettings, executor: StreamingExecutor) -> tuple[int, int, int]:
    """Activation budgets in bytes: what the user set, else the device memory the plan may use (the MILP takes the
    slots and working set out of it, `gpu_total_bytes`), a quarter of the available host RAM, and 80% of the spill
    dir's free space."""
    if settings.gpu_activation_gib is not None:
        gpu = int(settings.gpu_activation_gib * GIB)
    elif executor.device.type == "cuda":
        gpu = gpu_total_bytes(executor) or 0
    else:
        gpu = int(psutil.virtual_memory().available * 0.25)
    cpu = int(settings.cpu_activation_gib * GIB) if settings.cpu_activation_gib is not None else int(
        psutil.virtual_memory().available * 0.25)
    if settings.spill_dir is None:
        nvme = 0
    elif settings.nvme_activation_gib is not None:
        nvme = int(settings.nvme_activation_gib * GIB)
    else:
        nvme = int(shutil.disk_usage(settings.spill_dir).free * 0.8)
    return gpu, cpu, nvme


def write_plan(schedule: Schedule, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "lazytrain_plan.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(schedule.to_json())
    os.replace(tmp, path)
    return path
