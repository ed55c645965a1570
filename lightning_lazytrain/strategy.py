"""``LazyTrainStrategy``: Lightning glue around the streaming executor.

The user's LightningModule and its HF model stay as they are. At setup the strategy finds the one
``PreTrainedModel`` in the module, moves its parameters into the host store (they stay CPU parameters, so any
torch optimizer over ``module.parameters()`` updates the masters), and hooks the model so its forward streams.
What differs between one process and several is asked of the parallel layer (``parallel.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_lazytrain.admission import AdmissionReport, admission
from lightning_lazytrain.checkpointing import CheckpointingStrategy
from lightning_lazytrain.engine import StreamingExecutor
from lightning_lazytrain.engine.device import prefer_expandable_segments
from lightning_lazytrain.engine.generation.generate import EvalGeneration
from lightning_lazytrain.engine.generation.plan import GenerationMode, check_generation_mode
from lightning_lazytrain.engine.grads.homes import GradientHome, check_gradient_home
from lightning_lazytrain.models import adapter_for, find_hf_model
from lightning_lazytrain.models.fused_kernels import FusedKernels, check_fused_kernels, use_fused_kernels
from lightning_lazytrain.planning import LinkDrift, OomLadder, RunPlan
from lightning_lazytrain.planning.update_placement import DeviceStates, check_device_updates
from lightning_lazytrain.precision import LazyTrainPrecision
from lightning_lazytrain.resume import ResumeState
from lightning_lazytrain.schedule import Schedule
from lightning_lazytrain.schedule.plan_inputs import PlanSettings
from lightning_lazytrain.weight_averaging import install_weight_averaging_sync

log = logging.getLogger(__name__)


class LazyTrainStrategy(CheckpointingStrategy):
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
            (``engine/loss_kernel.py``); ``"none"`` turns that off too, so no Triton kernel runs at all.
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
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.model_attr = model_attr
        self.num_slots = num_slots
        self.prefetch_depth = prefetch_depth
        self.pin_memory = pin_memory
        self.timeout_s = timeout_s
        self.force_distributed = force_distributed
        self.fused_kernels = check_fused_kernels(fused_kernels)
        self.overlap_updates = overlap_updates
        self.device_updates = check_device_updates(device_update_share, device_update_states)
        self.gradient_home = check_gradient_home(gradient_home)
        self.generation_mode = check_generation_mode(generation)
        self.generation: EvalGeneration | None = None
        self.executor: StreamingExecutor | None = None
        self.last_step_stats: dict[str, float] = {}
        settings = PlanSettings(schedule, keep_graph_layers, gpu_activation_gib, cpu_activation_gib,
                                nvme_activation_gib, spill_dir, max_recompute_span, solver_time_limit, solver_mip_gap,
                                layer_micro_batches)
        prefer_expandable_segments()  # before Lightning starts CUDA
        self.run_plan = RunPlan(settings, OomLadder(steps=oom_fallback_steps), LinkDrift(every=replan_every_n_steps),
                                num_slots)
        self.resume = ResumeState(self.run_plan)
        self.admission_report: AdmissionReport | None = None

    @property
    def schedule(self) -> str:
        return self.run_plan.settings.schedule

    @property
    def schedule_result(self) -> Schedule | None:
        """The solved plan the run follows (the run plan's, which checkpoints carry)."""
        return self.run_plan.solved

    @property
    @override
    def precision_plugin(self) -> LazyTrainPrecision:
        return self._precision_plugin if self._precision_plugin is not None else LazyTrainPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, LazyTrainPrecision):
            plugin = LazyTrainPrecision(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    @override
    def setup_environment(self) -> None:
        if self.pin_memory and self.root_device.type != "cuda":
            raise ValueError("pin_memory=True needs a CUDA device; drop it or use accelerator='gpu'.")
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        precision = self.precision_plugin
        hf_model = find_hf_model(self.model, self.model_attr)
        if self.executor is None:
            adapter = adapter_for(hf_model)
            precision.convert_module(self.model)
            plan = self.run_plan.start(self.root_device.type, adapter.num_layers)
            pin = self.root_device.type == "cuda" if self.pin_memory is None else self.pin_memory
            self.executor = StreamingExecutor(
                adapter, self.root_device, precision.master_dtype, precision.stream_dtype, plan,
                num_slots=self.num_slots, prefetch_depth=self.prefetch_depth, pin_memory=pin,
                timeout_s=self.timeout_s, spill_dir=self.run_plan.settings.spill_dir, store_factory=self.store_factory,
                fused_kernels=use_fused_kernels(self.fused_kernels, self.root_device.type),
                loss_kernel=False if self.fused_kernels == "none" else None,
            )
            self.generation = EvalGeneration(self.executor, self.generation_mode)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            with self.optimizer_setup():
                self.setup_optimizers(trainer)
        if self.executor.path is None:
            optimizer = self.optimizers[0] if fitting and self.optimizers else None
            self.executor.use_path(self.update_path(fitting, optimizer, fitting and self._engine_can_update(trainer),
                                                    self.device_updates, self.gradient_home))
        engine_step = self._engine_step if fitting and self.executor.updates is not None else None
        precision.bind(self.root_device.type, self._drain_gradients, engine_step)
        if fitting:
            optimizer = self.executor.path.optimizer or (self.optimizers[0] if self.optimizers else None)
            self.admission_report = report = admission(self.executor, optimizer, precision.precision, *self.host_share)
            report.check()
            log.info("lazytrain admission:\n%s", report.table())
            log.info("lazytrain CPU update path: %s", getattr(optimizer, "kernel_path", type(optimizer).__name__))
            install_weight_averaging_sync(trainer, self.executor)
        self.setup_precision_plugin()

    def _engine_can_update(self, trainer: pl.Trainer) -> bool:
        """The engine runs the update itself: one optimizer that can update a subset of parameters
        (``step_params``), automatic optimization, no gradient accumulation, and ``overlap_updates``."""
        return (self.overlap_updates and len(self.optimizers) == 1 and hasattr(self.optimizers[0], "step_params")
                and self.lightning_module.automatic_optimization and trainer.accumulate_grad_batches == 1)

    @override
    def on_validation_end(self) -> None:
        """An evaluation's resident layer copies are dropped before training resumes."""
        if self.generation is not None:
            self.generation.release()

    on_test_end = on_predict_end = on_validation_end

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.on_validation_end()
        self.resume.before_batch()
        if self.executor is not None:
            trainer = self.lightning_module.trainer
            self.run_plan.before_batch(batch, self.executor, trainer.global_step,
                                       trainer.log_dir or trainer.default_root_dir)

    @override
    def model_to_device(self) -> None:
        """Parameters stay on the host; the executor moves what a step needs."""

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._drain_gradients()
        return loss

    def _drain_gradients(self) -> None:
        if self.executor is not None:
            self.executor.after_backward()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        assert self.executor is not None
        trainer = self.lightning_module.trainer
        result = self.run_plan.step_with_fallback(
            lambda: super(LazyTrainStrategy, self).optimizer_step(optimizer, closure, model, **kwargs),
            self.executor, trainer.global_step, trainer.accumulate_grad_batches, self.replans_alone)
        self.executor.after_optimizer_step()
        stats = {**self.executor.take_stats(), "skipped_steps": float(self.resume.skipped_steps)}
        if (plan := self.run_plan.solved) is not None:
            stats["predicted_exposed_s"] = float(plan.predicted_exposed_seconds)
            stats["predicted_stall_s"] = float(plan.predicted_stall_seconds)
        self.last_step_stats = stats
        return result

    @override
    def teardown(self) -> None:
        self.precision_plugin.unbind()
        self.resume.end_run()
        if self.generation is not None:
            self.generation.close()
            self.generation = None
        if self.executor is not None:
            self.executor.close()
            self.executor = None
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Stream HF decoder layers from host memory")

