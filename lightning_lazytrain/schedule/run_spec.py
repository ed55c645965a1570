"""The run and the machine a forecast is for (`forecast.py`): the strategy's arguments as the config sets them,
and what one process gets of the GPU, host RAM and disks."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

from lightning_lazytrain.models.adapter import ModelAdapter
from lightning_lazytrain.models.fused_kernels import liger_available

from .frozen_base import BaseCounts, count_base
from .gpus import GpuSpec
from .plan_inputs import PlanSettings


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
    schedule: str = "auto"  # a forecast is for a GPU: "auto" is the MILP there (`PlanSettings.on_device`)
    keep_graph_layers: int = 0
    prefetch_depth: int = 2
    gpu_activation_gib: float | None = None
    cpu_activation_gib: float | None = None
    nvme_activation_gib: float | None = None
    spill_dir: str | None = None
    max_recompute_span: int = 4
    layer_micro_batches: int | Literal["auto"] = "auto"  # "auto": the MILP's choice; an interval or JSON plan's 1
    solver_time_limit: float = 10.0
    solver_mip_gap: float = 0.01
    checkpoints_kept: int = 0  # full-state checkpoints the run keeps on disk (Lightning's default callback: 1)
    checkpoints_weights_only: bool = False  # those checkpoints hold the masters only (save_weights_only)
    fused_kernels: str = "auto"  # "auto": Liger's kernels when liger-kernel is installed here, as the run would
    gradient_home: str = "plan"  # where the gradients wait for the norm (`gradient_home.py`)
    quantize: str = "none"  # "nf4" / "fp4": the frozen linear weights of the decoder layers are 4-bit (QLoRA)

    @property
    def plan_settings(self) -> PlanSettings:
        """The plan arguments as the strategy holds them, on the GPU the forecast is for."""
        return PlanSettings(
            self.schedule,
            self.keep_graph_layers,
            self.gpu_activation_gib,
            self.cpu_activation_gib,
            self.nvme_activation_gib,
            self.spill_dir,
            self.max_recompute_span,
            self.solver_time_limit,
            self.solver_mip_gap,
            self.layer_micro_batches,
        ).on_device("cuda")

    @property
    def stream_dtype(self) -> torch.dtype:
        """What the engine streams and saves boundaries in: fp32 under 32-true, else bf16."""
        return torch.float32 if self.precision == "32-true" else torch.bfloat16

    @property
    def kernels_fused(self) -> bool:
        """Whether the run on a CUDA device binds Liger's kernels (``LazyTrainStrategy(fused_kernels=...)``)."""
        return self.fused_kernels == "liger" or (self.fused_kernels == "auto" and liger_available())

    @cached_property
    def counts(self) -> BaseCounts:
        """Trainable, frozen and 4-bit parameters and bytes (``frozen_base.py``); the model's ``requires_grad``
        flags say what trains (a LoRA model: the adapters)."""
        return count_base(self.adapter.model, list(self.adapter.layers), self.stream_dtype, self.quantize)

    @property
    def trainable_params(self) -> int:
        return self.counts.trainable_params

    @property
    def slot_bytes(self) -> int:
        """One weight slot: the largest decoder layer as it streams (4-bit weights as their packed bytes)."""
        return max(self.counts.layer_stream_bytes)
