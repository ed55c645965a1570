"""The forecast tests' shapes and setup: published shapes (the library's `NAMED_SHAPES`) on the meta device, the
recipes' optimizer, an H200 with a given memory, the analytic profile."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from lightning_lazytrain.models.adapter import ModelAdapter, adapter_for
from lightning_lazytrain.schedule.analytic import analytic_profile
from lightning_lazytrain.schedule.forecast import Machine, RunSpec
from lightning_lazytrain.schedule.gpus import GPUS
from lightning_lazytrain.sft.module import NAMED_SHAPES

GIB = 1 << 30
H200 = GPUS["h200"]


def named(name: str) -> PretrainedConfig:
    fields = dict(NAMED_SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def meta(config: PretrainedConfig) -> ModelAdapter:
    with torch.device("meta"):
        return adapter_for(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))


def lazytrain_run(adapter: ModelAdapter, **kw) -> RunSpec:
    # the recipes' optimizer: HybridAdamW with 2% 8-bit states
    kw.setdefault("schedule", "milp")
    return RunSpec(adapter, kw.pop("seq", 1024), optimizer_state_bytes_per_param=8.0 - 6.0 * 0.02, **kw)


def machine_of(memory_gib: float | None = None, host_gib: float = 120.0, gpu=H200) -> Machine:
    spec = gpu if memory_gib is None else replace(gpu, memory_bytes=int(memory_gib * GIB))
    return Machine(spec, int(host_gib * GIB))


def analytic_for(run: RunSpec, gpu=H200):
    return lambda b: analytic_profile(run.adapter, b, run.seq, gpu, run.stream_dtype)
