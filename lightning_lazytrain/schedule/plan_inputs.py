"""What an activation plan is solved from: the plan settings the strategy was given, and the machine's figures.

`PlanInputs` is built in two places and read in one: the run measures it on its executor at the first batch
(`lightning_lazytrain.planning.solve.executor_inputs`), ``lazytrain plan`` forecasts it for a machine it does not
run on (`forecast.plan_inputs`); `budgets`, `gpu_total_bytes` and `problem_for` are the one rule both then follow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal

from lightning_lazytrain.units import GIB

from .plan_problem import plan_problem, plan_total_bytes, run_micro_batches
from .problem import ScheduleProblem
from .profile import Profile

#: where ``schedule="auto"`` (the default) solves the MILP; elsewhere it is ``"interval:1"``
MILP_DEVICE_TYPES = ("cuda",)


@dataclass(frozen=True)
class PlanSettings:
    """The strategy's plan arguments of the same names. Frozen: the OOM ladder's lowered settings are a new one
    (`dataclasses.replace`), held by the run's plan (`planning.run_plan.RunPlan`)."""

    schedule: str = "auto"
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
            raise ValueError(
                f"layer_micro_batches={k!r}: use an integer >= 1 (each layer runs the batch in that "
                "many row slices) or 'auto' (the MILP takes the fewest with which a plan fits)"
            )

    def kind(self) -> str:
        if self.schedule == "auto":
            return "auto"
        if re.fullmatch(r"interval:\d+", self.schedule.strip()):
            return "interval"
        if self.schedule == "milp":
            return "milp"
        if self.schedule.endswith(".json"):
            return "json"
        raise ValueError(
            f"schedule={self.schedule!r} is not understood; use 'auto', 'interval:K' (K >= 1), 'milp', or a path to"
            " a plan JSON written by lightning_lazytrain.engine.Schedule.to_json()"
        )

    def on_device(self, device_type: str) -> PlanSettings:
        """These settings for a run on ``device_type``: ``"auto"`` is the MILP where a device's memory bounds the
        plan (CUDA), and ``"interval:1"`` elsewhere, so that a CPU run plans the same way on every machine."""
        if self.schedule != "auto":
            return self
        return replace(self, schedule="milp" if device_type in MILP_DEVICE_TYPES else "interval:1")


@dataclass(frozen=True)
class PlanInputs:
    """Everything `problem_for` reads besides the layer profile.

    ``device_bytes``: the device memory the whole plan may take before the allocator's margin (``None`` where no
    device memory bounds it: the CPU run); ``host_bytes``: the host RAM the default CPU budget is a quarter of;
    ``disk_bytes``: the spill dir's free space; ``update_held_bytes`` / ``update_reserve_bytes``: device bytes the
    GPU's share of the optimizer update keeps (masters and states; kept gradients and temporaries), which a
    refusal names."""

    settings: PlanSettings
    device_bytes: int | None
    host_bytes: int
    disk_bytes: int
    slot_bytes: int
    prefetch_depth: int
    loss_chunk_bytes: int
    head_grad_bytes: int
    update_held_bytes: int = 0
    update_reserve_bytes: int = 0


def gpu_total_bytes(inputs: PlanInputs) -> int | None:
    """Device bytes the whole plan may use (its slots, saved boundaries, graphs and working set), the margin off;
    ``None`` where no device memory limits the plan."""
    return None if inputs.device_bytes is None else plan_total_bytes(inputs.device_bytes)


def budgets(inputs: PlanInputs) -> tuple[int, int, int]:
    """(gpu, cpu, nvme) activation budgets in bytes: what the user set, else the device memory the plan may use
    (the MILP takes the slots and working set out of it), a quarter of the host RAM, and 80% of the spill dir's
    free space. Without a device bound the GPU budget is a quarter of the host RAM too."""
    s = inputs.settings
    total = gpu_total_bytes(inputs)
    if s.gpu_activation_gib is not None:
        gpu = int(s.gpu_activation_gib * GIB)
    elif total is not None:
        gpu = total
    else:
        gpu = int(inputs.host_bytes * 0.25)
    cpu = int(s.cpu_activation_gib * GIB) if s.cpu_activation_gib is not None else int(inputs.host_bytes * 0.25)
    if s.spill_dir is None:
        nvme = 0
    elif s.nvme_activation_gib is not None:
        nvme = int(s.nvme_activation_gib * GIB)
    else:
        nvme = int(inputs.disk_bytes * 0.8)
    return gpu, cpu, nvme


def problem_for(inputs: PlanInputs, profile: Profile) -> ScheduleProblem:
    """The placement problem for ``profile`` under these inputs' budgets and device total."""
    s = inputs.settings
    gpu, cpu, nvme = budgets(inputs)
    return plan_problem(
        profile,
        gpu,
        cpu,
        nvme,
        total_bytes=gpu_total_bytes(inputs),
        slot_bytes=inputs.slot_bytes,
        prefetch_depth=inputs.prefetch_depth,
        loss_chunk_bytes=inputs.loss_chunk_bytes,
        head_grad_bytes=inputs.head_grad_bytes,
        max_recompute_span=s.max_recompute_span,
        keep_graph_layers=s.keep_graph_layers,
        micro_batches=run_micro_batches(s.schedule, s.layer_micro_batches),
    )
