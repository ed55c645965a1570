"""Will a run fit, and how fast will it step? Admission, the plan and a step time for one batch, before any load.

Everything here reads shapes only, so the model can live on the meta device. Budgets follow what the strategy
does at its first batch (`lightning_lazytrain.planner.budgets`): the user's figures, else half the GPU memory
left after weight slots and resident parts, a quarter of the host RAM left after the run's own pieces, and 80%
of the spill dir's free space. The GPU budget is lowered further where the working set would not fit beside it,
and the forecast says which setting makes the run do the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightning_lazytrain.admission import AdmissionReport, admission_report
from lightning_lazytrain.engine.plan import Schedule
from lightning_lazytrain.models.adapter import ModelAdapter

from .analytic import analytic_profile, gpu_layout, model_flops_per_step
from .build import build_problem
from .disk import checkpoint_tier
from .gpus import GPUS, GpuSpec
from .milp import InfeasibleScheduleError, precheck, solve
from .problem import GIB
from .profile import Profile
from .step_time import StepPrediction, predict_step

MAX_BATCH = 1 << 14


@dataclass
class Machine:
    """What the run gets: one GPU per process, the host's available RAM, the spill dir's free disk."""

    gpu: GpuSpec
    host_available_bytes: int
    disk_free_bytes: int = 0
    update_params_per_s: float = 4.0e9
    checkpoint_free_bytes: int = 0


@dataclass
class RunSpec:
    """The run as the config sets it up; fields mirror `LazyTrainStrategy`'s arguments of the same names."""

    adapter: ModelAdapter
    seq: int
    precision: str = "bf16-mixed"
    optimizer_state_bytes_per_param: float = 8.0
    grad_accumulation: bool = False
    world_size: int = 1
    ranks_per_host: int = 1
    schedule: str = "interval:1"
    keep_graph_layers: int = 0
    prefetch_depth: int = 2
    gpu_activation_gib: float | None = None
    cpu_activation_gib: float | None = None
    nvme_activation_gib: float | None = None
    spill_dir: str | None = None
    max_recompute_span: int = 4
    solver_time_limit: float = 10.0
    solver_mip_gap: float = 0.01
    checkpoints_kept: int = 0  # full-state checkpoints the run keeps on disk (Lightning's default callback: 1)
    checkpoints_weights_only: bool = False  # those checkpoints hold the masters only (save_weights_only)

    @property
    def stream_dtype(self) -> torch.dtype:
        """What the engine streams and saves boundaries in: fp32 under 32-true, else bf16."""
        return torch.float32 if self.precision == "32-true" else torch.bfloat16

    @property
    def trainable_params(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.adapter.model.parameters()}.values())


@dataclass
class Forecast:
    batch: int
    report: AdmissionReport
    schedule: Schedule | None = None
    prediction: StepPrediction | None = None
    model_tflops: float = 0.0
    scaling: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.schedule is not None and self.report.fits

    @property
    def fits_gpu(self) -> bool:
        """A plan exists and the GPU tier fits (the host RAM may still be short)."""
        return self.schedule is not None and self.report.tiers["gpu"].short == 0

    def to_dict(self) -> dict:
        return {
            "batch": self.batch,
            "fits": self.fits,
            "fits_gpu": self.fits_gpu,
            "scaling": self.scaling,
            "notes": self.notes,
            "tiers": {
                key: {"need_bytes": t.need, "have_bytes": t.have, "pieces": t.pieces}
                for key, t in self.report.tiers.items()
            },
            "schedule": None if self.schedule is None else json.loads(self.schedule.to_json()),
            "prediction": None if self.prediction is None else self.prediction.to_dict(),
            "model_tflops": self.model_tflops,
        }


def _host_report(run: RunSpec, machine: Machine, cpu_act: int = 0, disk: int = 0, gpu: dict | None = None):
    return admission_report(
        num_params=run.trainable_params,
        host_have_bytes=machine.host_available_bytes,
        gpu_have_bytes=machine.gpu.memory_bytes,
        disk_have_bytes=machine.disk_free_bytes,
        precision=run.precision,
        optimizer_state_bytes_per_param=run.optimizer_state_bytes_per_param,
        grad_accumulation=run.grad_accumulation,
        cpu_activation_bytes=cpu_act,
        disk_bytes=disk,
        ranks_per_host=run.ranks_per_host,
        world_size=run.world_size,
        **(gpu or {}),
    )


def budgets(run: RunSpec, machine: Machine, batch: int) -> tuple[int, int, int, list[str]]:
    """(gpu, cpu, nvme) activation budgets in bytes for ``batch``, and notes on how they were chosen."""
    layout = gpu_layout(run.adapter, batch, run.seq, run.stream_dtype)
    first_slots = run.keep_graph_layers + 1 + max(1, run.prefetch_depth)  # the strategy's plan before the MILP
    free = machine.gpu.memory_bytes - first_slots * layout.slot_bytes - layout.resident_bytes
    notes = []
    if run.gpu_activation_gib is not None:
        gpu = int(run.gpu_activation_gib * GIB)
    else:
        gpu = max(0, free // 2)
        worst_slots = run.keep_graph_layers + run.max_recompute_span + max(1, run.prefetch_depth)
        room = max(0, machine.gpu.memory_bytes - layout.fixed_bytes(worst_slots))
        itemsize = run.stream_dtype.itemsize
        every_boundary = (
            (run.adapter.num_layers + 1) * batch * run.seq * run.adapter.model.config.hidden_size * itemsize
        )
        if room < min(gpu, every_boundary):  # the default budget would put more on the GPU than the room left
            # the run itself sizes the boundaries from the measured working set (planner.gpu_total_bytes), so
            # the budget is only advice for a user who wants this plan's
            notes.append(
                f"half the free GPU memory ({gpu / GIB:.2f} GiB) for boundaries would leave the estimated working "
                f"set too little, so this plan saves {room / GIB:.2f} GiB of them; the run sizes them itself from "
                f"the measured working set (to pin this budget: --trainer.strategy.init_args.gpu_activation_gib "
                f"{room / GIB:.2f})"
            )
            gpu = room
    host_need = _host_report(run, machine).tiers["host"].need
    cpu = (
        int(run.cpu_activation_gib * GIB)
        if run.cpu_activation_gib is not None
        else max(0, machine.host_available_bytes - host_need) // 4
    )
    if run.spill_dir is None:
        nvme = 0
    elif run.nvme_activation_gib is not None:
        nvme = int(run.nvme_activation_gib * GIB)
    else:
        nvme = int(machine.disk_free_bytes * 0.8)
    return gpu, cpu, nvme, notes


def admits(run: RunSpec, machine: Machine, batch: int) -> bool:
    """The cheap test: the GPU holds its fixed pieces and the two end boundaries, and some plan's boundaries fit
    the budgets (no solve, no profile). Host RAM does not depend on the batch: the forecast's report says it."""
    gpu, cpu, nvme, _ = budgets(run, machine, batch)
    # only the bytes of this profile are read (the pre-check), so any GPU's figures do
    problem = build_problem(
        analytic_profile(run.adapter, batch, run.seq, GPUS["h200"], run.stream_dtype),
        gpu,
        cpu,
        nvme,
        max_recompute_span=run.max_recompute_span,
    )
    ends = problem.activation_bytes[0] + problem.activation_bytes[-1]
    min_slots = run.keep_graph_layers + 1 + max(1, run.prefetch_depth)
    if (
        gpu_layout(run.adapter, batch, run.seq, run.stream_dtype).fixed_bytes(min_slots) + ends
        > machine.gpu.memory_bytes
    ):
        return False
    try:
        precheck(problem)
    except InfeasibleScheduleError:
        return False
    return _packs(problem)


def _packs(problem) -> bool:  # noqa: ANN001 - a ScheduleProblem
    """Equal boundaries (every profile here has them) are indivisible: count whole boundaries per home against the
    fewest interior ones a plan must save (one per ``max_recompute_span`` layers)."""
    a = problem.activation_bytes
    if len(set(a)) != 1 or a[0] == 0:
        return True
    gpu_room = problem.gpu_budget_bytes - 2 * a[0]
    whole = sum(max(0, b) // a[0] for b in (gpu_room, problem.cpu_budget_bytes, problem.nvme_budget_bytes))
    needed = -(-problem.num_layers // problem.max_recompute_span) - 1
    return whole >= needed


def _plan(run: RunSpec, profile: Profile, gpu: int, cpu: int, nvme: int) -> Schedule:
    kind = run.schedule.strip()
    n = run.adapter.num_layers
    problem = build_problem(profile, gpu, cpu, nvme, max_recompute_span=run.max_recompute_span)
    if kind == "milp":
        return solve(problem, time_limit=run.solver_time_limit, mip_gap=run.solver_mip_gap)
    if kind.endswith(".json"):
        with open(kind) as f:
            schedule = Schedule.from_json(f.read())
    else:
        schedule = Schedule.every(n, int(kind.split(":")[1]), run.keep_graph_layers)
    schedule.predicted_exposed_seconds = sum(problem.recompute_seconds(s, e) for s, e in schedule.blocks())
    return schedule


def forecast(run: RunSpec, machine: Machine, batch: int, profile_for: Callable[[int], Profile]) -> Forecast:
    """Admission, plan and predicted step for ``batch``; a forecast that does not fit says why in its notes."""
    gpu, cpu, nvme, notes = budgets(run, machine, batch)
    profile = profile_for(batch)
    scaling = str(profile.info.get("scaling", f"measured on {profile.device_name}"))
    try:
        schedule = _plan(run, profile, gpu, cpu, nvme)
    except (InfeasibleScheduleError, RuntimeError) as exc:
        return Forecast(batch, _host_report(run, machine), scaling=scaling, notes=[*notes, str(exc)])
    layout = gpu_layout(run.adapter, batch, run.seq, run.stream_dtype)
    sizes = dict.fromkeys(("gpu", "cpu", "nvme", "recompute"), 0)
    for a, tier in zip(profile.activation_bytes, schedule.tiers):
        sizes[tier] += a
    blocks = max((e - s for s, e in schedule.blocks()), default=1)
    slots = sum(schedule.keep_graph) + blocks + max(1, run.prefetch_depth)
    report = _host_report(
        run,
        machine,
        cpu_act=sizes["cpu"],
        disk=sizes["nvme"],
        gpu=dict(
            gpu_slot_bytes=slots * layout.slot_bytes,
            gpu_resident_bytes=layout.resident_bytes,
            gpu_workspace_bytes=layout.workspace_bytes,
            gpu_activation_bytes=sizes["gpu"],
        ),
    )
    if run.checkpoints_kept:
        state = 0.0 if run.checkpoints_weights_only else run.optimizer_state_bytes_per_param
        report.tiers["checkpoint"] = checkpoint_tier(
            run.trainable_params, run.precision, state, run.checkpoints_kept, machine.checkpoint_free_bytes
        )
    share = run.ranks_per_host / run.world_size  # the host's CPU updates this share of the parameters
    prediction = predict_step(profile, schedule, run.trainable_params * share / machine.update_params_per_s)
    config = run.adapter.model.config
    flops = model_flops_per_step(run.trainable_params, run.adapter.num_layers, config.hidden_size, batch, run.seq)
    return Forecast(batch, report, schedule, prediction, flops / prediction.step_s / 1e12, scaling, notes)


def largest_batch(
    run: RunSpec, machine: Machine, profile_for: Callable[[int], Profile], tries: int = 3
) -> Forecast | None:
    """The largest batch the GPU takes: the largest the cheap test admits (doubling, then bisection), confirmed by
    a full forecast; a batch the MILP cannot pack steps down by one, ``tries`` times at most. None when not even
    batch 1 is admitted."""
    if not admits(run, machine, 1):
        return None
    low, high = 1, 2  # admits(low); high is the first batch known not to be admitted (or past MAX_BATCH)
    while high <= MAX_BATCH and admits(run, machine, high):
        low, high = high, high * 2
    high = min(high, MAX_BATCH + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if admits(run, machine, mid) else (low, mid)
    for batch in range(low, max(0, low - tries), -1):
        result = forecast(run, machine, batch, profile_for)
        if result.fits_gpu:
            return result
    return result
