"""From the ``schedule=`` argument to a ``Schedule``: a fixed interval, a JSON plan, or the MILP solved here.

The MILP needs the batch shape, so ``"milp"`` is solved at the first training batch: profile the layers (cached per
machine and shape), measure the plan's inputs on the executor (`executor_inputs`), build the problem with their
budgets, solve with HiGHS; `write_plan` puts the plan as JSON beside the logs.
"""

from __future__ import annotations

import logging
import os
import shutil

import psutil

from lightning_lazytrain.engine import Schedule, StreamingExecutor
from lightning_lazytrain.engine.device import device_free_bytes
from lightning_lazytrain.schedule import InfeasibleScheduleError, Profile, profile_model, solve
from lightning_lazytrain.schedule.plan_inputs import PlanInputs, PlanSettings, budgets, gpu_total_bytes, problem_for
from lightning_lazytrain.schedule.plan_problem import head_grad_sum_bytes, run_micro_batches
from lightning_lazytrain.units import GIB

log = logging.getLogger(__name__)


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
            raise ValueError(
                f"keep_graph_layers={settings.keep_graph_layers} does not apply to the plan file "
                f"{settings.schedule}: its 'keep_graph' list says which layers keep their graph; set it "
                "there, or drop keep_graph_layers"
            )
        if settings.layer_micro_batches not in (1, "auto"):
            raise ValueError(
                f"layer_micro_batches={settings.layer_micro_batches} does not apply to the plan file "
                f"{settings.schedule}: set its 'micro_batches' there, or drop layer_micro_batches"
            )
        with open(settings.schedule) as f:
            schedule = Schedule.from_json(f.read())
        if schedule.num_layers != num_layers:
            raise ValueError(
                f"the plan in {settings.schedule} is for {schedule.num_layers} layers, the model has {num_layers}"
            )
        return schedule
    return Schedule.every(num_layers, 1, 0)


def device_plan_bytes(executor: StreamingExecutor) -> int | None:
    """Device bytes the plan may take before the allocator's margin: what is free now plus the slot pool it
    replaces, less what device-side updates keep free for themselves. ``None`` off CUDA, where no device memory
    limits the plan."""
    if executor.device.type != "cuda":
        return None
    # no pool after a failed step was discarded (the OOM ladder re-plans then): its memory is already free
    slots = len(executor.pool.slots) if executor.pool is not None else 0
    pool = slots * executor.slot_numel * executor.store.stream_dtype.itemsize
    return device_free_bytes(executor.device) + pool - executor.device_update_reserve_bytes


def executor_inputs(settings: PlanSettings, executor: StreamingExecutor) -> PlanInputs:
    """The plan's inputs as the run stands now: the executor's device memory, slots and head, the host RAM
    available and the spill dir's free space."""
    return PlanInputs(
        settings,
        device_bytes=device_plan_bytes(executor),
        host_bytes=psutil.virtual_memory().available,
        disk_bytes=_spill_free_bytes(settings),
        slot_bytes=executor.slot_numel * executor.store.stream_dtype.itemsize,
        prefetch_depth=executor.prefetch_depth,
        loss_chunk_bytes=executor.loss_chunk_bytes,
        head_grad_bytes=head_grad_sum_bytes(executor.adapter.lm_head),
        update_held_bytes=executor.device_update_held_bytes,
        update_reserve_bytes=executor.device_update_reserve_bytes,
    )


def _spill_free_bytes(settings: PlanSettings) -> int:
    """The spill dir's free space, read only where the NVMe budget comes from it."""
    if settings.spill_dir is None or settings.nvme_activation_gib is not None:
        return 0
    return shutil.disk_usage(settings.spill_dir).free


def measure_profile(settings: PlanSettings, executor: StreamingExecutor, shape: tuple[int, int]) -> Profile:
    """The layers profiled for ``shape`` (rows, length) on the executor's device, its hooks lifted."""
    with executor.unhooked():
        return profile_model(
            executor.adapter, *shape, executor.device, executor.store.stream_dtype, spill_dir=settings.spill_dir
        )


def solve_plan(inputs: PlanInputs, profile: Profile) -> Schedule:
    """Build and solve the MILP for ``profile`` under ``inputs``; a refusal names the budget that set it."""
    settings = inputs.settings
    try:
        schedule = solve(
            problem_for(inputs, profile), time_limit=settings.solver_time_limit, mip_gap=settings.solver_mip_gap
        )
    except InfeasibleScheduleError as exc:
        notes = []
        cpu = budgets(inputs)[1]
        if exc.saved_boundaries and settings.cpu_activation_gib is None:
            notes.append(
                f"The CPU budget, {cpu / GIB:.3f} GiB, is a quarter of the {cpu / GIB * 4:.1f} GiB of host "
                "RAM available at this batch: cpu_activation_gib sets it"
            )
        held = inputs.update_held_bytes + inputs.update_reserve_bytes
        if gpu_total_bytes(inputs) is not None and held:
            notes.append(
                f"Of the device memory, {held / GIB:.3f} GiB is held for the GPU's share of the optimizer "
                f"update ({inputs.update_held_bytes / GIB:.3f} GiB of masters and states kept or "
                "staged there): device_update_states='staged', a lower device_update_share, or "
                "device_update_share=0.0 leaves it to the plan"
            )
        if not notes:
            raise
        raise InfeasibleScheduleError(". ".join([str(exc), *notes]), exc.saved_boundaries) from exc
    log.info("lazytrain plan: %s, predicted exposed %.3f s", schedule.counts(), schedule.predicted_exposed_seconds)
    return schedule


def write_plan(schedule: Schedule, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "lazytrain_plan.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(schedule.to_json())
    os.replace(tmp, path)
    return path
