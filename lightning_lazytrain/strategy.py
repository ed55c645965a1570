"""``LazyTrainStrategy``: Lightning glue around the streaming executor.

The user's LightningModule and its HF model stay as they are; the strategy's parts do the work, and each Lightning
hook here hands off to one: the executor (``run_engine.RunEngine``), the processes (``parallel.ProcessGroup``), the
checkpoints (``checkpointing.RunCheckpoints``), the run's plan and its OOM ladder (``planning/``) and the state a
resume restores (``resume.ResumeState``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_lazytrain.admission import AdmissionReport
from lightning_lazytrain.checkpointing import RunCheckpoints, with_atomic_default
from lightning_lazytrain.engine import StreamingExecutor
from lightning_lazytrain.engine.device import prefer_expandable_segments
from lightning_lazytrain.engine.generation.generate import EvalGeneration
from lightning_lazytrain.engine.generation.plan import GenerationMode, check_generation_mode
from lightning_lazytrain.engine.grads.homes import GradientHome, check_gradient_home
from lightning_lazytrain.models.fused_kernels import FusedKernels, check_fused_kernels
from lightning_lazytrain.parallel import ProcessGroup, processes_attribute, processes_method
from lightning_lazytrain.planning import LinkDrift, OomLadder, RunPlan, step_with_fallback
from lightning_lazytrain.planning.update_placement import DeviceStates, check_device_updates
from lightning_lazytrain.precision import LazyTrainPrecision
from lightning_lazytrain.resume import ResumeState
from lightning_lazytrain.run_engine import RunEngine
from lightning_lazytrain.schedule import Schedule
from lightning_lazytrain.schedule.plan_inputs import PlanSettings


class LazyTrainStrategy(ParallelStrategy):
    """Stream an HF decoder's layers through one device from host memory; one process per device.

    Args:
        model_attr: attribute of the LightningModule holding the HF model; found automatically when there is one.
        schedule: ``"auto"`` (default): ``"milp"`` on CUDA, ``"interval:1"`` on other devices (the fastest plan
            that fits the GPU, and a fixed one elsewhere); ``"interval:K"`` keeps every K-th layer boundary on the
            device and recomputes the rest in the backward (``"interval:1"``: every boundary kept, one re-forward
            per layer); ``"milp"`` solves the activation plan (GPU / CPU / NVMe / recompute per boundary, kept
            graphs) at the first training batch, and again before a larger one; a path to a ``.json`` plan runs
            that plan.
        keep_graph_layers: the last N layers keep their whole autograd graph on the device (no re-forward).
        num_slots: device weight slots; default: what the plan needs plus ``prefetch_depth``.
        prefetch_depth: how many layers ahead weights are copied while the current one computes.
        pin_memory: pin the streamed host buffers (CUDA only; ``None`` = when on CUDA).
        overlap_updates: with an optimizer that can update a subset of parameters (``HybridAdamW``), automatic
            optimization and no gradient accumulation, the engine runs the update per layer on a worker thread from
            bf16 host gradients, hidden behind the next forward. ``.grad`` is then not filled on the host.
        device_update_share: share of the parameters whose update runs on the GPU beside the CPU's (CUDA, overlapped
            updates): ``"plan"`` (default) the update-placement MILP's split (``milp_updates.py``), none on the CPU
            accelerator; ``0.0`` none; ``None`` chosen from the CPU update rate and link measured at setup; other
            values force that share, also on the CPU accelerator (the torch reference update on copies: a test of
            the control flow).
        device_update_states: where that share's fp32 masters and optimizer states live between steps: ``"resident"``
            on the GPU, ``"staged"`` copied in and out per update, ``"auto"`` resident on CUDA as far as they fit.
        gradient_home: with the engine's own updates, where the other units' gradients wait for the global norm
            (``engine/grads/homes.py``): ``"host"`` pinned host buffers (the whole model's gradients in host RAM),
            ``"device"`` kept on the GPU and staged to the host unit by unit for the update, ``"nvme"`` written to
            ``spill_dir`` and read back for the update; ``"plan"`` (default) the host when they fit its RAM, else
            the device, else NVMe. Clipping uses the exact global norm in every home.
        timeout_s: longest wait for any transfer before an error names it.
        gpu_activation_gib / cpu_activation_gib / nvme_activation_gib: activation budgets for the MILP (default:
            the device memory the plan may use, a quarter of the available host RAM, 80% of the spill dir's free
            space); the MILP also fits its slots, kept graphs and working sets into that device memory.
        spill_dir: directory for NVMe activation homes (files are removed at teardown and after a crash).
        layer_micro_batches: each layer runs the batch in this many row slices and sums their weight gradients:
            the same loss, gradients equal up to rounding, a per-layer working set about that many times smaller;
            ``"auto"``: the MILP takes the fewest (1, 2, 4, ...) with which a plan fits the device, other plans 1.
        checkpoint_io: default ``AtomicCheckpointIO`` (atomic saves, verified loads; see docs/reliability.md).
        solver_time_limit / solver_mip_gap: HiGHS limits for the MILP.
        generation: how ``generate`` runs at evaluation: ``"auto"`` loads every layer onto the device once per
            evaluation when they fit beside the KV cache (freed before training resumes), else streams them per
            decode step for as many prompts as fit; ``"resident"`` / ``"streamed"`` force one (printed with bytes).
        oom_fallback_steps: an out-of-memory error in the first N optimizer steps re-plans one rung down (smaller
            GPU budget, more recompute, CPU/NVMe homes, twice the layer micro-batches; ``planning/oom_ladder.py``)
            and runs the step again; 0 stops at the first.
        replan_every_n_steps: with an MILP plan on CUDA, probe the link every N steps and solve the plan
            again when it drifted from the profile by more than 25% (``planning/replan.py``); 0: never.
        fused_kernels: ``"auto"`` (default) runs the decoder layers' RMSNorm, SwiGLU MLP and RoPE through Liger-Kernel's
            Triton kernels when on CUDA with ``liger-kernel`` installed (faster, smaller graphs; bf16 rounding differs
            from HF's by what TRL's ``use_liger_kernel`` differs); ``"liger"`` insists; ``"none"`` runs HF's own.
            Apart from it, the head's loss runs lazytrain's own Triton kernel on CUDA where Triton is importable
            (``engine/loss/kernel.py``); ``"none"`` turns that off too, so no Triton kernel runs at all.
        force_distributed: run the multi-process path even with one process (``devices=1``, one node): a process
            group of one rank (NCCL on CUDA, gloo on the CPU), sharded store, updates and checkpoints. For testing
            and timing that path on one device; it trains to the same weights as the default one-process path.

    With ``devices=N`` / ``num_nodes=M`` every process streams through its own device, and master weights,
    gradients and optimizer states are sharded across processes (``docs/engine.md``, "Several GPUs").
    """

    strategy_name = "lazytrain"

    def __init__(
        self,
        model_attr: str | None = None,
        schedule: str = "auto",
        keep_graph_layers: int = 0,
        num_slots: int | None = None,
        prefetch_depth: int = 2,
        pin_memory: bool | None = None,
        overlap_updates: bool = True,
        device_update_share: float | Literal["plan"] | None = "plan",
        device_update_states: DeviceStates = "auto",
        gradient_home: GradientHome = "plan",
        timeout_s: float = 600.0,
        gpu_activation_gib: float | None = None,
        cpu_activation_gib: float | None = None,
        nvme_activation_gib: float | None = None,
        spill_dir: str | None = None,
        max_recompute_span: int = 4,
        layer_micro_batches: int | Literal["auto"] = "auto",
        solver_time_limit: float = 10.0,
        solver_mip_gap: float = 0.01,
        generation: GenerationMode = "auto",
        oom_fallback_steps: int = 3,
        replan_every_n_steps: int = 50,
        fused_kernels: FusedKernels = "auto",
        force_distributed: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self.processes = ProcessGroup(timeout_s, force_distributed)  # before Lightning sets what it forwards there
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.engine = RunEngine(
            model_attr, num_slots, prefetch_depth, pin_memory, timeout_s, check_fused_kernels(fused_kernels),
            overlap_updates, check_device_updates(device_update_share, device_update_states),
            check_gradient_home(gradient_home), check_generation_mode(generation))
        self.last_step_stats: dict[str, float] = {}
        settings = PlanSettings(schedule, keep_graph_layers, gpu_activation_gib, cpu_activation_gib,
                                nvme_activation_gib, spill_dir, max_recompute_span, solver_time_limit, solver_mip_gap,
                                layer_micro_batches)
        prefer_expandable_segments()  # before Lightning starts CUDA
        self.run_plan = RunPlan(settings, OomLadder(steps=oom_fallback_steps), LinkDrift(every=replan_every_n_steps),
                                num_slots)
        self.resume = ResumeState(self.run_plan)
        self.checkpoints = RunCheckpoints(self.resume, self.processes)
        self.admission_report: AdmissionReport | None = None

    @property
    def executor(self) -> StreamingExecutor | None:
        return self.engine.executor

    @property
    def generation(self) -> EvalGeneration | None:
        return self.engine.generation

    @property
    def schedule(self) -> str:
        return self.run_plan.settings.schedule

    @property
    def schedule_result(self) -> Schedule | None:
        """The solved plan the run follows (the run plan's, which checkpoints carry)."""
        return self.run_plan.solved

    parallel_devices = processes_attribute("devices", settable=True)
    cluster_environment = processes_attribute("cluster_environment", settable=True)
    num_nodes = processes_attribute("num_nodes", settable=True)
    root_device = processes_attribute("root_device")
    is_distributed = processes_attribute("distributed")  # True: Lightning adds a DistributedSampler
    distributed_sampler_kwargs = processes_attribute("sampler_kwargs")
    restore_checkpoint_after_setup = processes_attribute("distributed")  # sharded loads need the engine's shards

    def _configure_launcher(self) -> None:
        self._launcher = self.processes.launcher()

    set_world_ranks = processes_method("set_world_ranks")
    reduce = processes_method("reduce")
    barrier = processes_method("barrier")
    broadcast = processes_method("broadcast")

    def tensor_init_context(self, empty_init: bool | None = None) -> AbstractContextManager[None]:
        return self.processes.init_context(self.precision_plugin)

    @property
    def precision_plugin(self) -> LazyTrainPrecision:
        return self._precision_plugin if self._precision_plugin is not None else LazyTrainPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, LazyTrainPrecision):
            plugin = LazyTrainPrecision(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    def setup_environment(self) -> None:
        self.engine.check_device(self.root_device)
        super().setup_environment()
        self.processes.open()

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.engine.build(self.model, self.precision_plugin, self.root_device, self.run_plan, self.processes,
                          self.lightning_module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            with self.processes.optimizer_setup():
                self.setup_optimizers(trainer)
        self.engine.choose_path(self.processes, trainer, self.optimizers, fitting)
        self.engine.bind(self.precision_plugin, trainer, self.resume.engine_step if fitting else None)
        if fitting:
            self.admission_report = self.engine.admit(self.optimizers, self.precision_plugin.precision,
                                                      self.processes, trainer)
        self.setup_precision_plugin()

    def on_validation_end(self) -> None:
        self.engine.release_generation()

    on_test_end = on_predict_end = on_validation_end

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.on_validation_end()
        self.resume.before_batch()
        if (executor := self.executor) is not None:
            trainer = self.lightning_module.trainer
            self.run_plan.before_batch(batch, executor, trainer.global_step,
                                       trainer.log_dir or trainer.default_root_dir)

    def model_to_device(self) -> None:
        """Parameters stay on the host; the executor moves what a step needs."""

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self.engine.after_backward()
        return loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The step through the OOM ladder's retry loop (``planning/oom_ladder.py``), then the step's stats."""
        assert self.executor is not None
        trainer = self.lightning_module.trainer
        run_step = functools.partial(super().optimizer_step, optimizer, closure, model, **kwargs)
        result = step_with_fallback(run_step, self.run_plan, self.executor, trainer.global_step,
                                    trainer.accumulate_grad_batches, self.processes.replans_alone)
        self.last_step_stats = {**self.engine.after_step(), "skipped_steps": float(self.resume.skipped_steps),
                                **self.run_plan.predicted_seconds()}
        return result

    @property
    def checkpoint_io(self) -> CheckpointIO:
        self._checkpoint_io = with_atomic_default(self._checkpoint_io)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpoints.model_state(self.executor, self.lightning_module)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        state = self.executor.optimizer_state() if self.executor is not None else None
        return state if state is not None else super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        self.checkpoints.save(checkpoint, filepath, storage_options, self.checkpoint_io, self.executor,
                              self.lightning_module)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        self.checkpoints.remove(filepath, self.checkpoint_io)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        read = functools.partial(super().load_checkpoint, weights_only=weights_only)
        return self.checkpoints.load(checkpoint_path, read, self.lightning_module)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self.checkpoints.load_model_state(checkpoint, self.executor, self.lightning_module):
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self.checkpoints.load_optimizer_states(checkpoint, self.executor, self.optimizers)

    def teardown(self) -> None:
        self.precision_plugin.unbind()
        self.resume.end_run()
        self.engine.close()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Stream HF decoder layers from host memory")
