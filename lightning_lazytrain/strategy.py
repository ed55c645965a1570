"""``LazyTrainStrategy``: Lightning glue around the streaming executor.

The user's LightningModule and its HF model stay as they are. At setup the strategy finds the one
``PreTrainedModel`` in the module, moves its parameters into the host store (they stay CPU parameters, so any
torch optimizer over ``module.parameters()`` updates the masters), and hooks the model so its forward streams.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from transformers import PreTrainedModel

from lightning_lazytrain.checkpoint import sharded as sharded_checkpoint
from lightning_lazytrain.checkpoint.atomic import AtomicCheckpointIO, CorruptCheckpointError
from lightning_lazytrain.engine import StreamingExecutor
from lightning_lazytrain.engine.device import device_free_bytes
from lightning_lazytrain.engine.generation import EvalGeneration
from lightning_lazytrain.engine.link import measure_link_cuda
from lightning_lazytrain.engine.weights.shared_store import SharedParamStore
from lightning_lazytrain.faults import GpuMemoryError, gpu_out_of_memory
from lightning_lazytrain.memory import admission
from lightning_lazytrain.models import adapter_for
from lightning_lazytrain.oom_ladder import OomLadder, discard_step, milp_resolver
from lightning_lazytrain.optim.hybrid_adamw import defer_state_allocation
from lightning_lazytrain.parallel import ProcessGroupStrategy
from lightning_lazytrain.planner import PlanSettings, initial_plan, plan_of, solve_plan, write_plan
from lightning_lazytrain.precision import LazyTrainPrecision
from lightning_lazytrain.replan import LinkDrift
from lightning_lazytrain.resume import STATE_KEY, ResumeState, fallback_for_last
from lightning_lazytrain.schedule import AdmissionReport, Schedule
from lightning_lazytrain.schedule.generation import GENERATION_MODES, GenerationMode

log = logging.getLogger(__name__)


class ModelNotFoundError(ValueError):
    pass


class LazyTrainStrategy(ProcessGroupStrategy):
    """Stream an HF decoder's layers through one device from host memory; one process per device.

    Args:
        model_attr: attribute of the LightningModule holding the HF model; found automatically when there is one.
        schedule: ``"interval:K"`` keeps every K-th layer boundary on the device and recomputes the rest in the
            backward (``"interval:1"``: every boundary kept, one re-forward per layer); ``"milp"`` solves the
            activation plan (GPU / CPU / NVMe / recompute per boundary) at the first training batch; a path to a
            ``.json`` plan runs that plan.
        keep_graph_layers: the last N layers keep their whole autograd graph on the device (no re-forward).
        num_slots: device weight slots; default: what the plan needs plus ``prefetch_depth``.
        prefetch_depth: how many layers ahead weights are copied while the current one computes.
        pin_memory: pin the streamed host buffers (CUDA only; ``None`` = when on CUDA).
        overlap_updates: with an optimizer that can update a subset of parameters (``HybridAdamW``), automatic
            optimization and no gradient accumulation, the engine runs the update per layer on a worker thread from
            bf16 host gradients, hidden behind the next forward. ``.grad`` is then not filled on the host.
        device_update_share: with overlapped updates on CUDA, the share of parameters whose update runs on the GPU
            at the same time as the CPU's (their gradients stay on the device; masters and states are copied in
            and out). ``0.0`` (default): all on the CPU, which measured faster on the H200 (docs/benchmarks.md);
            ``None``: a share chosen from the CPU update rate and the link bandwidth measured at setup. Other
            values force that share, also on the CPU accelerator (where the "device" path is the torch reference
            update on copies: a test of the control flow).
        timeout_s: longest wait for any transfer before an error names it.
        gpu_activation_gib / cpu_activation_gib / nvme_activation_gib: activation budgets for the MILP (default:
            half the free GPU memory, a quarter of the available host RAM, 80% of the spill dir's free space).
        spill_dir: directory for NVMe activation homes (files are removed at teardown and after a crash).
        checkpoint_io: default ``AtomicCheckpointIO`` (atomic saves, verified loads; see docs/reliability.md).
        solver_time_limit / solver_mip_gap: HiGHS limits for the MILP.
        generation: how the model's ``generate`` runs (evaluation): ``"auto"`` loads every layer onto the device
            once per evaluation when they fit beside the KV cache (plain HF decoding speed; freed before training
            resumes) and otherwise streams them once per decode step for as many prompts as fit; ``"resident"`` /
            ``"streamed"`` force one. The choice and its bytes are printed.
        oom_fallback_steps: an out-of-memory error in the first N optimizer steps re-plans one rung down (smaller
            GPU budget, more recompute, CPU/NVMe homes; ``lightning_lazytrain/oom_ladder.py``) and runs the step
            again; 0 stops at the first.
        replan_every_n_steps: with ``schedule="milp"`` on CUDA, probe the link every N steps and solve the plan
            again when it drifted from the profile by more than 25% (``lightning_lazytrain/replan.py``); 0: never.

    With ``devices=N`` / ``num_nodes=M`` every process streams through its own device, and master weights,
    gradients and optimizer states are sharded across processes (``docs/engine.md``, "Several GPUs").
    """

    strategy_name = "lazytrain"

    def __init__(
        self,
        model_attr: str | None = None,
        schedule: str = "interval:1",
        keep_graph_layers: int = 0,
        num_slots: int | None = None,
        prefetch_depth: int = 2,
        pin_memory: bool | None = None,
        overlap_updates: bool = True,
        device_update_share: float | None = 0.0,
        timeout_s: float = 600.0,
        gpu_activation_gib: float | None = None,
        cpu_activation_gib: float | None = None,
        nvme_activation_gib: float | None = None,
        spill_dir: str | None = None,
        max_recompute_span: int = 4,
        solver_time_limit: float = 10.0,
        solver_mip_gap: float = 0.01,
        generation: GenerationMode = "auto",
        oom_fallback_steps: int = 3,
        replan_every_n_steps: int = 50,
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
        self.overlap_updates = overlap_updates
        if device_update_share is not None and not 0.0 <= device_update_share <= 1.0:
            raise ValueError(f"device_update_share must be in [0, 1] or None (automatic), got {device_update_share}")
        self.device_update_share = device_update_share
        if generation not in GENERATION_MODES:
            raise ValueError(f"generation must be one of {GENERATION_MODES}, got {generation!r}")
        self.generation_mode = generation
        self.generation: EvalGeneration | None = None
        self.executor: StreamingExecutor | None = None
        self.last_step_stats: dict[str, float] = {}
        self.plan_settings = PlanSettings(schedule, keep_graph_layers, gpu_activation_gib, cpu_activation_gib,
                                          nvme_activation_gib, spill_dir, max_recompute_span, solver_time_limit,
                                          solver_mip_gap)
        self.plan_settings.kind()
        self.resume = ResumeState()
        self.admission_report: AdmissionReport | None = None
        self.oom_ladder = OomLadder(steps=oom_fallback_steps)
        self.link_drift = LinkDrift(every=replan_every_n_steps)

    @property
    def schedule(self) -> str:
        return self.plan_settings.schedule

    @property
    def schedule_result(self) -> Schedule | None:
        """The solved plan the run follows (owned by ``resume``, which saves it with the checkpoint)."""
        return self.resume.schedule_result

    @property
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO) and self._checkpoint_io.checkpoint_io is None:
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @property
    def precision_plugin(self) -> LazyTrainPrecision:
        return self._precision_plugin if self._precision_plugin is not None else LazyTrainPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, LazyTrainPrecision):
            plugin = LazyTrainPrecision(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    def setup_environment(self) -> None:
        if self.pin_memory and self.root_device.type != "cuda":
            raise ValueError("pin_memory=True needs a CUDA device; drop it or use accelerator='gpu'.")
        super().setup_environment()

    def find_hf_model(self, module: nn.Module) -> PreTrainedModel:
        if self.model_attr is not None:
            model = getattr(module, self.model_attr, None)
            if not isinstance(model, PreTrainedModel):
                raise ModelNotFoundError(
                    f"{type(module).__name__}.{self.model_attr} is {type(model).__name__}, not a transformers"
                    " PreTrainedModel; point model_attr at the attribute holding the HF causal LM."
                )
            return model
        found = [(name, m) for name, m in module.named_modules() if isinstance(m, PreTrainedModel)]
        outer = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
        if not outer:
            raise ModelNotFoundError(
                f"{type(module).__name__} holds no transformers PreTrainedModel; lazytrain streams the layers of one"
                " HF causal LM (e.g. self.model = AutoModelForCausalLM.from_pretrained(...))."
            )
        if len(outer) > 1:
            names = ", ".join(n for n, _ in outer)
            raise ModelNotFoundError(
                f"{type(module).__name__} holds several PreTrainedModels ({names});"
                " say which one to stream with LazyTrainStrategy(model_attr=...)."
            )
        return outer[0][1]

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        precision = self.precision_plugin
        precision.device_type = self.root_device.type
        precision.after_closure_hook = self._drain_gradients
        hf_model = self.find_hf_model(self.model)
        if self.executor is None:
            adapter = adapter_for(hf_model)
            precision.convert_module(self.model)
            plan = initial_plan(self.plan_settings, adapter.num_layers)
            pin = self.root_device.type == "cuda" if self.pin_memory is None else self.pin_memory
            store_kw = {}
            if self.distributed:
                store_kw["store_factory"] = functools.partial(SharedParamStore, topology=self.topology)
            self.executor = StreamingExecutor(
                adapter,
                self.root_device,
                precision.master_dtype,
                precision.stream_dtype,
                plan,
                num_slots=self.num_slots,
                prefetch_depth=self.prefetch_depth,
                pin_memory=pin,
                timeout_s=self.timeout_s,
                spill_dir=self.plan_settings.spill_dir,
                **store_kw,
            )
            self.generation = EvalGeneration(self.executor, self.generation_mode)
        if trainer.state.fn == TrainerFn.FITTING:
            if self.distributed:
                with defer_state_allocation():  # the engine's shard optimizer holds the states
                    self.setup_optimizers(trainer)
            else:
                self.setup_optimizers(trainer)
            self._maybe_direct_updates(trainer)
            optimizer = self.optimizers[0] if self.optimizers else None
            if self.distributed and optimizer is not None:
                optimizer = self.executor.updates.optimizer
            topo = self.topology
            report = admission(self.executor, optimizer, precision.precision,
                               topo.local_world if topo else 1, topo.world_size if topo else 1)
            self.admission_report = report
            report.check()
            log.info("lazytrain admission:\n%s", report.table())
        self.setup_precision_plugin()

    def _maybe_direct_updates(self, trainer: pl.Trainer) -> None:
        precision = self.precision_plugin
        precision.direct_step = None
        if self.executor is None or self.executor.updates is not None:
            return
        eligible = (self.overlap_updates and len(self.optimizers) == 1 and hasattr(self.optimizers[0], "step_params")
                    and self.lightning_module.automatic_optimization and trainer.accumulate_grad_batches == 1)
        if not eligible:
            if self.distributed:
                raise ValueError(
                    "lazytrain with several processes shards the optimizer inside the engine: it needs one"
                    " lightning_lazytrain.optim.HybridAdamW, automatic optimization, accumulate_grad_batches=1 and"
                    " overlap_updates=True"
                )
            return
        if self.distributed:
            self.executor.enable_sharded_updates(self.optimizers[0])
        else:
            self.executor.enable_direct_updates(self.optimizers[0], self.device_update_share)
        trainer_ref = trainer

        def direct_step(clip_val: float | None) -> None:
            try:
                stepped = self.executor.direct_step(clip_val, self.resume.nonfinite_guard, trainer_ref.global_step)
            except RuntimeError as exc:
                reason = str(exc).rstrip(".")
                raise RuntimeError(f"{reason}. Last good checkpoint: {_last_checkpoint(trainer_ref)}") from exc
            if not stepped:
                self.resume.skipped_steps += 1
                log.warning("lazytrain: non-finite gradient norm at step %d, step skipped (%d so far)",
                            trainer_ref.global_step, self.resume.skipped_steps)

        precision.direct_step = direct_step

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.executor is not None:
            self.executor.wait_updates()
            if self.distributed:
                return self.executor.store.shard_state()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.executor is not None:
            self.executor.wait_updates()
            if self.distributed and self.executor.updates is not None:
                return self.executor.updates.state_dict()
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        checkpoint[STATE_KEY] = self.resume.dump()
        if not self.distributed:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        assert self.executor is not None
        meta = None
        if self.is_global_zero:
            meta = sharded_checkpoint.layout_meta(self.executor.store, self.executor.adapter.model)
        sharded_checkpoint.save_sharded(checkpoint, filepath, self.global_rank, meta)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if sharded_checkpoint.is_sharded(checkpoint_path):
            checkpoint = sharded_checkpoint.load_sharded(checkpoint_path, self.global_rank, self.world_size)
        else:
            try:
                checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
            except CorruptCheckpointError as err:
                # fit(ckpt_path="last") resolved to a last*.ckpt that does not verify: take the newest one that does
                checkpoint = super().load_checkpoint(fallback_for_last(str(checkpoint_path), err), weights_only)
        self.resume.load(checkpoint.get(STATE_KEY))
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.distributed and os.path.isdir(filepath):
            if self.is_global_zero:
                sharded_checkpoint.remove_sharded(filepath)
            return
        super().remove_checkpoint(filepath)

    def on_validation_end(self) -> None:
        """An evaluation's resident layer copies are dropped before training resumes."""
        if self.generation is not None:
            self.generation.release()

    on_test_end = on_predict_end = on_validation_end

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.on_validation_end()
        self.resume.before_batch()
        if self.plan_settings.kind() != "milp" or self.executor is None:
            return
        if self.resume.schedule_result is not None:
            self._maybe_replan()
            return
        ids = batch["input_ids"] if isinstance(batch, Mapping) else getattr(batch, "input_ids", None)
        if ids is None:
            raise ValueError("schedule='milp' plans for the batch shape: the batch must carry input_ids (B, T)")
        batch_size, seq = ids.shape[0], ids.shape[-1]
        self.resume.plan_shape = (batch_size, seq)
        saved = self.resume.saved_plan((batch_size, seq))
        self.resume.schedule_result = saved or solve_plan(self.plan_settings, self.executor, batch_size, seq)
        self.executor.set_plan(plan_of(self.resume.schedule_result), self.num_slots)
        if saved is not None:
            log.info("lazytrain: running the plan saved in the checkpoint for batch %d x %d", batch_size, seq)
            return
        trainer = self.lightning_module.trainer
        path = write_plan(self.resume.schedule_result, trainer.log_dir or trainer.default_root_dir)
        log.info("lazytrain: plan for batch %d x %d written to %s", batch_size, seq, path)

    def _maybe_replan(self) -> None:
        """At a step boundary: solve again when the link drifted from the profile the plan was solved for."""
        trainer = self.lightning_module.trainer
        if self.link_drift.probe is None and self.root_device.type == "cuda":
            self.link_drift.probe = functools.partial(measure_link_cuda, self.root_device)
        profile = self.link_drift.check(trainer.global_step, getattr(self.resume.schedule_result, "profile", None))
        if profile is None or self.resume.plan_shape is None:
            return
        shape = self.resume.plan_shape
        self.resume.schedule_result = solve_plan(self.plan_settings, self.executor, *shape, profile=profile)
        self.executor.set_plan(plan_of(self.resume.schedule_result), self.num_slots)
        path = write_plan(self.resume.schedule_result, trainer.log_dir or trainer.default_root_dir)
        log.warning("lazytrain: re-planned at step %d: %s, predicted exposed %.3f s, written to %s",
                    trainer.global_step, self.resume.schedule_result.counts(),
                    self.resume.schedule_result.predicted_exposed_seconds, path)

    def model_to_device(self) -> None:
        """Parameters stay on the host; the executor moves what a step needs."""

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._drain_gradients()
        return loss

    def _out_of_memory(self, exc: BaseException) -> GpuMemoryError:
        device = self.root_device
        free = device_free_bytes(device) if device.type == "cuda" else None
        plan = self.executor.plan if self.executor is not None else None
        counts = {h: plan.homes.count(h) for h in sorted(set(plan.homes))} if plan is not None else {}
        described = f"{counts}, {plan.graph_layers} layers keep their graph" if plan is not None else "not set"
        return gpu_out_of_memory(exc, free, self.resume.plan_shape, described)

    def _fallback_plan(self):
        """The next rung's plan while the ladder applies (one process, first steps, no accumulation), else None."""
        trainer = self.lightning_module.trainer
        if (self.executor is None or self.distributed or trainer.global_step >= self.oom_ladder.steps
                or trainer.accumulate_grad_batches != 1):
            return None
        shape = self.resume.plan_shape
        resolve = milp_resolver(self.plan_settings, self.executor, shape) if (
            self.plan_settings.kind() == "milp" and shape is not None) else None
        return self.oom_ladder.next_plan(self.executor.plan, self.plan_settings.spill_dir, resolve)

    def _drain_gradients(self) -> None:
        if self.executor is not None:
            self.executor.after_backward()

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        while True:
            try:
                result = super().optimizer_step(optimizer, closure, model, **kwargs)
                break
            except torch.OutOfMemoryError as exc:
                plan = self._fallback_plan()
                if plan is None:
                    raise self._out_of_memory(exc) from exc
            # outside the except block: the failed step's frames, and the GPU memory they held, are gone
            discard_step(self.executor)
            if self.root_device.type == "cuda":
                torch.cuda.empty_cache()
            self.executor.set_plan(plan, self.num_slots)
        if self.executor is not None:
            self.executor.after_optimizer_step()
            stats = {**self.executor.take_stats(), "skipped_steps": float(self.resume.skipped_steps)}
            if self.resume.schedule_result is not None:
                stats["predicted_exposed_s"] = float(self.resume.schedule_result.predicted_exposed_seconds)
            self.last_step_stats = stats
        return result

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.distributed and self.executor is not None:
            self.executor.wait_updates()
            self.executor.store.load_shard_state(checkpoint["state_dict"])
            return
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.executor is not None:
            self.executor.after_optimizer_step()

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.distributed and self.executor is not None and self.executor.updates is not None:
            self.executor.updates.load_state_dict(checkpoint["optimizer_states"][0])
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)

    def teardown(self) -> None:
        self.precision_plugin.direct_step = None
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
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Stream HF decoder layers from host memory")


def _last_checkpoint(trainer: pl.Trainer) -> str:
    """The newest checkpoint a ModelCheckpoint callback wrote, for the abort message. Skipped steps leave the
    weights untouched, so a checkpoint written after one still holds the last good weights."""
    paths = [getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "")
             for cb in trainer.checkpoint_callbacks]
    paths = [p for p in paths if p]
    return paths[-1] if paths else "none (no ModelCheckpoint has saved yet)"
