"""Will a run fit, and how fast will it step? Admission, the plan and a step time for one batch, before any load.

Everything here reads shapes only, so the model can live on the meta device. The plan is the one the strategy
solves at its first batch (`lightning_lazytrain.planning.solve.solve_plan`), from the same `PlanInputs`
(`plan_inputs.py`): the device memory the plan may use is the GPU's less the resident embedding/head copy the
executor holds when the planner measures what is free, less the same margin (`gpu_total_bytes`); the MILP takes
the weight slots, kept graphs, MLP re-runs and the per-layer working set of the profile out of it. The other
budgets are the user's figures, else a quarter of the host RAM left after the run's own pieces and 80% of the
spill dir's free space. The GPU tier of the report is that memory model, piece by piece, so it fits exactly when
the MILP's device row holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_lazytrain.admission import AdmissionReport, admission_report
from lightning_lazytrain.engine.grads.homes import HOST_HEADROOM_SHARE, STAGING_BUFFERS, choose_gradient_home
from lightning_lazytrain.engine.loss.chunked import LOSS_CHUNK_BYTES
from lightning_lazytrain.engine.plan import Schedule

from .analytic import gpu_layout, model_flops_per_step
from .checkpoint_modes import CheckpointMode, checkpoint_modes, fitting_modes_text
from .disk import checkpoint_tier
from .layer_backward import trained_numel
from .milp import InfeasibleScheduleError, solve
from .milp_memory import plan_gpu_pieces
from .plan_inputs import PlanInputs, budgets, gpu_total_bytes
from .plan_inputs import problem_for as inputs_problem
from .plan_problem import head_grad_sum_bytes
from .problem import GIB, ScheduleProblem
from .profile import Profile
from .run_spec import Machine, RunSpec
from .step_time import StepPrediction, predict_step


@dataclass
class Forecast:
    batch: int
    report: AdmissionReport
    schedule: Schedule | None = None
    prediction: StepPrediction | None = None
    model_tflops: float = 0.0
    scaling: str = ""
    notes: list[str] = field(default_factory=list)
    gradient_home: str = "host"
    checkpoint_modes: list[CheckpointMode] = field(default_factory=list)
    checkpoints_kept: int = 0

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
            "gradient_home": self.gradient_home,
            "checkpoint_modes": [vars(m) for m in self.checkpoint_modes],
            "checkpoint_verdict": fitting_modes_text(self.checkpoint_modes, self.checkpoints_kept)
            if self.checkpoint_modes else None,
        }


def _host_report(run: RunSpec, machine: Machine, cpu_act: int = 0, disk: int = 0, gpu: dict | None = None,
                 home: str | None = None):
    home = gradient_home(run, machine) if home is None else home
    return admission_report(
        num_params=run.trainable_params,
        frozen_params=run.counts.frozen_params,
        frozen_4bit_bytes=run.counts.frozen_4bit_bytes,
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
        gradient_home=home,
        gradient_staging_bytes=staging_bytes(run) if home != "host" else 0,
        **(gpu or {}),
    )


def gradient_bytes(run: RunSpec) -> int:
    """Every trainable parameter's gradient in the stream dtype."""
    return run.trainable_params * run.stream_dtype.itemsize


def staging_bytes(run: RunSpec) -> int:
    """The staging buffers of a gradient home off the host: the largest layer's (or parameter's) trainable size,
    twice (`engine/grads/homes.staging_numel`; a LoRA layer stages its adapters only)."""
    layer = max(trained_numel(layer) for layer in run.adapter.layers)
    largest = max((p.numel() for p in run.adapter.model.parameters() if p.requires_grad), default=0)
    return STAGING_BUFFERS * max(layer, largest) * run.stream_dtype.itemsize


def gradient_home(run: RunSpec, machine: Machine) -> str:
    """The home the run's gradients get on ``machine``, as the strategy decides ``"plan"`` at setup
    (`engine/grads/homes.py`): the host when 90% of the host RAM left after the run's other pieces holds them,
    else the device when they fit half its memory beside the resident copy, else NVMe with a spill dir. Several
    processes and gradient accumulation keep them on the host."""
    if run.gradient_home != "plan":
        return run.gradient_home
    if run.world_size > 1 or run.grad_accumulation:
        return "host"
    without = _host_report(run, machine, home="host").tiers["host"].need - gradient_bytes(run)
    left = int((machine.host_available_bytes - without) * (1 - HOST_HEADROOM_SHARE))
    resident = gpu_layout(run.adapter, run.stream_dtype).resident_copy_bytes
    device = machine.gpu.memory_bytes - resident if machine.gpu.name != "cpu" else None
    return choose_gradient_home(gradient_bytes(run), left, device, run.spill_dir)


def plan_inputs(run: RunSpec, machine: Machine) -> PlanInputs:
    """The inputs the strategy's planner measures at the first batch (`planning.solve.executor_inputs`), for
    ``machine``: the device memory is the GPU's less the executor's resident embedding/norm/head copy, the one
    piece it holds outside the plan when the free memory is measured (its slot pool is added back), less the
    gradients of a device home (the strategy's reserve); the host RAM the CPU budget is a quarter of is what is
    left after the run's own pieces."""
    layout = gpu_layout(run.adapter, run.stream_dtype)
    reserve = gradient_bytes(run) if gradient_home(run, machine) == "device" else 0
    host_need = _host_report(run, machine).tiers["host"].need
    return PlanInputs(
        run.plan_settings,
        device_bytes=machine.gpu.memory_bytes - layout.resident_copy_bytes - reserve,
        host_bytes=max(0, machine.host_available_bytes - host_need),
        disk_bytes=machine.disk_free_bytes,
        slot_bytes=run.slot_bytes,
        prefetch_depth=run.prefetch_depth,
        loss_chunk_bytes=LOSS_CHUNK_BYTES,
        head_grad_bytes=head_grad_sum_bytes(run.adapter.lm_head),
    )


def problem_for(run: RunSpec, machine: Machine, profile: Profile) -> ScheduleProblem:
    """The problem `planning.solve.solve_plan` would build on ``machine`` for ``profile``."""
    return inputs_problem(plan_inputs(run, machine), profile)


def plan(run: RunSpec, problem: ScheduleProblem) -> Schedule:
    """The MILP's plan for ``problem``, or the interval / JSON plan the run names, charged its re-forwards."""
    settings = run.plan_settings
    if settings.kind() == "milp":
        return solve(problem, time_limit=settings.solver_time_limit, mip_gap=settings.solver_mip_gap)
    if settings.kind() == "json":
        with open(settings.schedule) as f:
            schedule = Schedule.from_json(f.read())
    else:
        schedule = Schedule.every(problem.num_layers, int(settings.schedule.split(":")[1]), run.keep_graph_layers)
        schedule.micro_batches = problem.micro_batches
    schedule.predicted_exposed_seconds = sum(problem.recompute_seconds(s, e) for s, e in schedule.blocks())
    return schedule


def _gpu_pieces(run: RunSpec, machine: Machine, problem: ScheduleProblem, schedule: Schedule) -> dict[str, int]:
    """The GPU tier's pieces for ``schedule``: the resident copy, the margin, and what the MILP's device row
    charges the plan; their sum is at most the GPU's memory exactly when that row holds."""
    resident = gpu_layout(run.adapter, run.stream_dtype).resident_copy_bytes
    charged = plan_gpu_pieces(problem, schedule.homes, schedule.keep_graph, schedule.mlp_recompute)
    reserve = gradient_bytes(run) if gradient_home(run, machine) == "device" else 0
    available = max(0, machine.gpu.memory_bytes - resident - reserve)
    return dict(
        gpu_slot_bytes=charged["slots"],
        gpu_resident_bytes=resident,
        gpu_graph_bytes=charged["graphs"],
        gpu_workspace_bytes=charged["peak"],
        gpu_activation_bytes=charged["boundaries"],
        gpu_margin_bytes=available - (gpu_total_bytes(plan_inputs(run, machine)) or 0),
    )


def forecast(run: RunSpec, machine: Machine, batch: int, profile_for: Callable[[int], Profile]) -> Forecast:
    """Admission, plan and predicted step for ``batch``; a forecast that does not fit says why in its notes."""
    profile = profile_for(batch)
    scaling = str(profile.info.get("scaling", f"measured on {profile.device_name}"))
    try:
        problem = problem_for(run, machine, profile)
        schedule = plan(run, problem)
    except (ValueError, RuntimeError) as exc:  # no plan fits (InfeasibleScheduleError), a bad setting, none found
        notes = [str(exc)]
        if isinstance(exc, InfeasibleScheduleError) and exc.saved_boundaries and run.cpu_activation_gib is None:
            cpu = budgets(plan_inputs(run, machine))[1]
            notes.append(f"the CPU budget, {cpu / GIB:.3f} GiB, is a quarter of the {4 * cpu / GIB:.1f} GiB of host "
                         "RAM left after the run's own pieces: cpu_activation_gib sets it")
        return Forecast(batch, _host_report(run, machine), scaling=scaling, notes=notes)
    sizes = dict.fromkeys(("gpu", "cpu", "nvme", "recompute"), 0)
    for a, tier in zip(profile.activation_bytes, schedule.homes):
        sizes[tier] += a
    report = _host_report(
        run, machine, cpu_act=sizes["cpu"], disk=sizes["nvme"], gpu=_gpu_pieces(run, machine, problem, schedule)
    )
    modes = []
    if run.checkpoints_kept:
        state = 0.0 if run.checkpoints_weights_only else run.optimizer_state_bytes_per_param
        report.tiers["checkpoint"] = checkpoint_tier(
            run.trainable_params, run.precision, state, run.checkpoints_kept, machine.checkpoint_free_bytes
        )
        modes = checkpoint_modes(run.trainable_params, run.precision, run.optimizer_state_bytes_per_param,
                                 run.checkpoints_kept, machine.checkpoint_free_bytes)
    share = run.ranks_per_host / run.world_size  # the host's CPU updates this share of the parameters
    prediction = predict_step(profile, schedule, run.trainable_params * share / machine.update_params_per_s)
    config = run.adapter.model.config
    counts = run.counts
    flops = model_flops_per_step(counts.model_params, run.adapter.num_layers, config.hidden_size, batch, run.seq,
                                 frozen_params=counts.model_params - counts.trainable_params)
    return Forecast(batch, report, schedule, prediction, flops / prediction.step_s / 1e12, scaling,
                    gradient_home=gradient_home(run, machine), checkpoint_modes=modes,
                    checkpoints_kept=run.checkpoints_kept)
