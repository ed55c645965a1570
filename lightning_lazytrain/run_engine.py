"""The strategy's engine part: the executor a run streams through and what it is built with.

``RunEngine`` holds the strategy's arguments that shape the executor (checked when the strategy is built), builds
the executor over the module's HF model at the first setup (kept across ``fit`` / ``validate`` until teardown),
chooses its update path once, runs the admission check before a fit, and owns the evaluation generation beside it.
The strategy's hooks hand over what Lightning gives them: the module, the precision plugin, the device, the run's
plan and the process group.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import lightning.pytorch as pl
import torch

from lightning_lazytrain.admission import AdmissionReport, admission
from lightning_lazytrain.engine import StreamingExecutor
from lightning_lazytrain.engine.generation.generate import EvalGeneration
from lightning_lazytrain.engine.generation.plan import GenerationMode
from lightning_lazytrain.engine.grads.homes import GradientHome
from lightning_lazytrain.models import adapter_for, find_hf_model
from lightning_lazytrain.models.fused_kernels import FusedKernels, use_fused_kernels
from lightning_lazytrain.parallel import ProcessGroup
from lightning_lazytrain.planning import RunPlan
from lightning_lazytrain.planning.update_placement import DeviceUpdates
from lightning_lazytrain.precision import LazyTrainPrecision
from lightning_lazytrain.weight_averaging import install_weight_averaging_sync

log = logging.getLogger(__name__)


class RunEngine:
    """Built from the strategy's arguments of the same names (``LazyTrainStrategy`` documents them), checked there.
    ``executor`` and ``generation`` are None before the first setup and after teardown."""

    def __init__(
        self,
        model_attr: str | None,
        num_slots: int | None,
        prefetch_depth: int,
        pin_memory: bool | None,
        timeout_s: float,
        fused_kernels: FusedKernels,
        overlap_updates: bool,
        device_updates: DeviceUpdates,
        gradient_home: GradientHome,
        generation_mode: GenerationMode,
    ) -> None:
        self.model_attr, self.num_slots, self.prefetch_depth = model_attr, num_slots, prefetch_depth
        self.pin_memory, self.timeout_s, self.fused_kernels = pin_memory, timeout_s, fused_kernels
        self.overlap_updates, self.device_updates, self.gradient_home = overlap_updates, device_updates, gradient_home
        self.generation_mode = generation_mode
        self.executor: StreamingExecutor | None = None
        self.generation: EvalGeneration | None = None

    def check_device(self, device: torch.device) -> None:
        """At ``setup_environment``, once the device is known."""
        if self.pin_memory and device.type != "cuda":
            raise ValueError("pin_memory=True needs a CUDA device; drop it or use accelerator='gpu'.")

    def build(
        self,
        model: torch.nn.Module,
        precision: LazyTrainPrecision,
        device: torch.device,
        run_plan: RunPlan,
        processes: ProcessGroup,
        module: pl.LightningModule,
    ) -> StreamingExecutor:
        """The executor over ``model``'s one HF model (converted to the precision's dtypes) on the plan's start,
        built once: a later setup of the same strategy (``validate`` after ``fit``) keeps it. The HF model is looked
        for at every setup, so a module without one is refused then."""
        hf_model = find_hf_model(model, self.model_attr)
        if self.executor is not None:
            return self.executor
        adapter = adapter_for(hf_model)
        precision.convert_module(model)
        plan = run_plan.start(device.type, adapter.num_layers)
        pin = device.type == "cuda" if self.pin_memory is None else self.pin_memory
        self.executor = StreamingExecutor(
            adapter,
            device,
            precision.master_dtype,
            precision.stream_dtype,
            plan,
            num_slots=self.num_slots,
            prefetch_depth=self.prefetch_depth,
            pin_memory=pin,
            timeout_s=self.timeout_s,
            spill_dir=run_plan.settings.spill_dir,
            store_factory=processes.store_factory(module),
            fused_kernels=use_fused_kernels(self.fused_kernels, device.type),
            loss_kernel=False if self.fused_kernels == "none" else None,
        )
        self.generation = EvalGeneration(self.executor, self.generation_mode)
        return self.executor

    def choose_path(
        self, processes: ProcessGroup, trainer: pl.Trainer, optimizers: list[torch.optim.Optimizer], fitting: bool
    ) -> None:
        """The run's gradient/update path, chosen once (``ProcessGroup.update_path``)."""
        executor = self.executor
        assert executor is not None
        if executor.path is not None:
            return
        optimizer = optimizers[0] if fitting and optimizers else None
        engine_can_update = fitting and self.engine_can_update(trainer, optimizers)
        executor.use_path(
            processes.update_path(
                executor, fitting, optimizer, engine_can_update, self.device_updates, self.gradient_home
            )
        )

    def bind(
        self,
        precision: LazyTrainPrecision,
        trainer: pl.Trainer,
        engine_step: Callable[[StreamingExecutor, pl.Trainer, float | None], None] | None,
    ) -> None:
        """Hand the precision plugin the device, the wait for host gradients, and, when the engine runs the update
        itself during a fit, ``engine_step`` (``ResumeState.engine_step``: it counts the skipped steps)."""
        executor = self.executor
        assert executor is not None
        step = None
        if engine_step is not None and executor.updates is not None:
            step = functools.partial(engine_step, executor, trainer)
        precision.bind(executor.device.type, self.after_backward, step)

    def engine_can_update(self, trainer: pl.Trainer, optimizers: list[torch.optim.Optimizer]) -> bool:
        """The engine runs the update itself: one optimizer that can update a subset of parameters
        (``step_params``), automatic optimization, no gradient accumulation, and ``overlap_updates``."""
        return (
            self.overlap_updates
            and len(optimizers) == 1
            and hasattr(optimizers[0], "step_params")
            and trainer.lightning_module.automatic_optimization
            and trainer.accumulate_grad_batches == 1
        )

    def admit(
        self, optimizers: list[torch.optim.Optimizer], precision: str, processes: ProcessGroup, trainer: pl.Trainer
    ) -> AdmissionReport:
        """Before a fit: refuse a run this host or device cannot hold (``admission.py``), log what it needs, and
        keep Lightning's weight-averaging callbacks in step with the engine (``weight_averaging.py``)."""
        executor = self.executor
        assert executor is not None and executor.path is not None
        optimizer = executor.path.optimizer or (optimizers[0] if optimizers else None)
        report = admission(executor, optimizer, precision, *processes.host_share)
        report.check()
        log.info("lazytrain admission:\n%s", report.table())
        log.info("lazytrain CPU update path: %s", getattr(optimizer, "kernel_path", type(optimizer).__name__))
        install_weight_averaging_sync(trainer, executor)
        return report

    def after_backward(self) -> None:
        """Wait for the gradients the backward sent to the host."""
        if self.executor is not None:
            self.executor.after_backward()

    def after_step(self) -> dict[str, float]:
        """After an optimizer step: the step's measured stats."""
        assert self.executor is not None
        self.executor.after_optimizer_step()
        return self.executor.take_stats()

    def release_generation(self) -> None:
        """An evaluation's resident layer copies are dropped before training resumes."""
        if self.generation is not None:
            self.generation.release()

    def close(self) -> None:
        if self.generation is not None:
            self.generation.close()
            self.generation = None
        if self.executor is not None:
            self.executor.close()
            self.executor = None
