"""The systems of the benchmark suite: how each one builds its model, strategy, precision and optimizer.

Every system trains the same ``BenchModule`` through the Lightning ``Trainer``; only what a user would change
to switch trainers differs. ``work_ratio`` is executed over model FLOPs of the decoder stack (re-forwards of
activation checkpointing and lazytrain's recompute blocks); the head is not re-run and is left out of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from common import DEVICE, BenchModule, ChunkedLossModule, host_model, qwen_config, random_model

from lightning_lazytrain import LazyTrainStrategy

SYSTEMS = ("gpu-resident", "gpu-resident-ckpt", "gpu-resident-liger", "gpu-resident-ckpt-liger",
           "gpu-resident-liger-flce", "gpu-resident-ckpt-liger-flce", "lazytrain", "lazytrain-default",
           "lazytrain-cpu-updates", "lazytrain-hf-kernels", "lazytrain-one-rank-nccl", "lazytrain-gpu-updates",
           "lazytrain-gpu-updates-plan", "lazytrain-gpu-updates-plan-staged", "lazytrain-gpu-updates-all",
           "lazytrain-interval4",
           "lazytrain-interval4-overlap", "lazytrain-micro4", "lazytrain-whole-batch",
           "fsdp-cpu-offload", "fsdp-cpu-offload-fused", "fsdp-cpu-offload-fused-nockpt", "deepspeed-z3-offload",
           "deepspeed-z3-offload-fair", "deepspeed-z3-offload-fair-nockpt", "deepspeed-z3-ratio",
           "deepspeed-z3-gpu-params", "deepspeed-z3-gpu-params-nockpt", "deepspeed-z3-gpu-params-ratio")
# the systems that run every decoder layer's forward twice (activation checkpointing of every layer)
CHECKPOINTED = {"gpu-resident-ckpt", "gpu-resident-ckpt-liger", "gpu-resident-ckpt-liger-flce", "fsdp-cpu-offload",
                "fsdp-cpu-offload-fused", "deepspeed-z3-offload", "deepspeed-z3-offload-fair", "deepspeed-z3-ratio",
                "deepspeed-z3-gpu-params", "deepspeed-z3-gpu-params-ratio"}
# DeepSpeed's sub-groups are what its offload ratio splits between the GPU and the CPU (the first
# int((1 - ratio) * n) on the GPU), so the rows with a ratio take groups of 1e8 parameters: about 3% of the 3B shape
RATIO_SUB_GROUP = int(1e8)


# the lazytrain systems with the engine's overlapped update: strategy arguments (besides schedule="milp") and what
# the row's optimizer label adds
OVERLAPPED = {
    "lazytrain": ({}, ""),
    # the A/B of the default share of the update on the GPU ("plan"): every update on the CPU
    "lazytrain-cpu-updates": ({"device_update_share": 0.0}, ", every update on the CPU"),
    # the A/B of Liger's fused norm and SwiGLU, which "lazytrain" runs by default where liger-kernel is installed
    "lazytrain-hf-kernels": ({"fused_kernels": "none"}, ", HF's own norm and MLP kernels, the torch loss"),
    # issue 17: the multi-process path (process group, sharded sink, reduce-scatter) on one GPU
    "lazytrain-one-rank-nccl": ({"force_distributed": True}, ", force_distributed=True (one-rank NCCL)"),
    "lazytrain-gpu-updates": ({"device_update_share": None}, ", a measured share of the updates on the GPU"),
    "lazytrain-gpu-updates-plan": ({"device_update_share": "plan"}, ", the MILP's share on the GPU, states kept there"),
    "lazytrain-gpu-updates-plan-staged": ({"device_update_share": "plan", "device_update_states": "staged"},
                                          ", the MILP's share on the GPU, states copied in and out"),
    "lazytrain-gpu-updates-all": ({"device_update_share": 1.0},
                                  ", every update on the GPU that fits, states kept there"),
    "lazytrain-interval4-overlap": ({"schedule": "interval:4"}, ""),
    # issue 16's last OOM rung taken up front: each layer in four row slices, a quarter of its working set
    "lazytrain-micro4": ({"layer_micro_batches": 4}, ", each layer in 4 row slices"),
    # "lazytrain" lets the MILP choose the slices; this one runs every layer on the whole batch
    "lazytrain-whole-batch": ({"layer_micro_batches": 1}, ", each layer on the whole batch"),
}


@dataclass
class SystemRun:
    module: BenchModule
    strategy: object
    precision: str
    optimizer: str
    trainer_kw: dict = field(default_factory=dict)
    note: str = ""


def _decoder_layer_class(model) -> type:
    return type(model.model.layers[0])


def build(system: str, shape: str, batch: int, host_cache: dict, fp32_adamw: bool = True,
          gpu_share: float | None = None) -> SystemRun:
    """``host_cache`` keeps one host model per shape for the lazytrain systems (they leave it unchanged);
    the GPU-resident, FSDP and DeepSpeed systems get a fresh model each, since they move or wrap it. ``gpu_share``:
    the share of the update the ``-ratio`` DeepSpeed systems keep on the GPU (``offload_optimizer.ratio`` is the
    rest)."""
    clip = {"gradient_clip_val": 1.0}
    if system.startswith("gpu-resident"):
        model = random_model(shape, DEVICE, torch.bfloat16)
        if "-ckpt" in system:
            model.gradient_checkpointing_enable()
        if "-liger" in system:  # the same kernels lazytrain's layers run: the ceiling for it
            from lightning_lazytrain.models.fused_kernels import fuse_decoder_kernels

            fuse_decoder_kernels(model.model.layers)
        flce = system.endswith("-flce")  # the head's loss in chunks, as lazytrain's head runs it
        module = ChunkedLossModule(model) if flce else BenchModule(model, "adamw")
        return SystemRun(module, "auto", "bf16-true", "torch AdamW (GPU)", clip,
                         "Liger's fused linear cross-entropy" if flce else "")
    if system == "lazytrain-default":  # what strategy="lazytrain" gives: no option set
        model = _cached_host_model(shape, host_cache)
        return SystemRun(BenchModule(model, "hybrid1"), LazyTrainStrategy(), "bf16-mixed",
                         "HybridAdamW 8-bit states, the strategy's defaults", clip)
    if system.startswith("lazytrain"):
        model = _cached_host_model(shape, host_cache)
        # 8-bit states: on the H200 host's 16 cores the one-loop 8-bit update is the faster one (4.99 vs 3.74
        # G params/s with bf16 grads, clip and stream copy: optim_cpu_324b44b_cpu16.json) and a quarter the bytes
        hybrid, label = "hybrid1", "HybridAdamW 8-bit states"
        if system in OVERLAPPED:
            kwargs, note = OVERLAPPED[system]
            return SystemRun(BenchModule(model, hybrid), LazyTrainStrategy(**{"schedule": "milp", **kwargs}),
                             "bf16-mixed", f"{label}, overlapped{note}", clip)
        opt = "adamw" if fp32_adamw else "hybrid1"
        return SystemRun(BenchModule(model, opt), LazyTrainStrategy(schedule="interval:4", overlap_updates=False),
                         "bf16-mixed", "torch AdamW fp32 (CPU), after backward" if fp32_adamw else
                         "HybridAdamW 8-bit, after backward", clip,
                         "" if fp32_adamw else "fp32 AdamW states refused by admission control; 8-bit states")
    if system.startswith("fsdp-cpu-offload"):
        from lightning.pytorch.strategies import FSDPStrategy

        model = host_model(shape)
        layer = _decoder_layer_class(model)
        checkpointed = {"activation_checkpointing_policy": {layer}} if system in CHECKPOINTED else {}
        strategy = FSDPStrategy(cpu_offload=True, auto_wrap_policy={layer}, **checkpointed)
        fused = "-fused" in system
        return SystemRun(BenchModule(model, "adamw" if fused else "adamw-default"), strategy, "bf16-mixed",
                         "torch AdamW fused=True (CPU)" if fused else "torch AdamW defaults (CPU)", {},
                         "unclipped: Lightning's FSDPPrecision refuses gradient_clip_algorithm='norm'")
    if system.startswith("deepspeed-z3-") and system != "deepspeed-z3-offload":
        return _deepspeed(system, shape, batch, gpu_share, clip)
    if system == "deepspeed-z3-offload":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        model = host_model(shape)
        model.gradient_checkpointing_enable()
        strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                                     logging_batch_size_per_gpu=batch)
        return SystemRun(BenchModule(model, "deepspeed"), strategy, "bf16-mixed", "DeepSpeedCPUAdam", clip)
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


def _cached_host_model(shape: str, host_cache: dict):
    if shape not in host_cache:
        host_cache.clear()
        host_cache[shape] = host_model(shape)
    model = host_cache[shape]
    model.zero_grad(set_to_none=True)
    return model


def _deepspeed(system: str, shape: str, batch: int, gpu_share: float | None, clip: dict) -> SystemRun:
    """The ZeRO-3 systems set up as DeepSpeed's offload docs advise (pinned host buffers, the model built under
    zero.Init in ``configure_model``, optimizer steps in sub-groups): ``-gpu-params`` keeps the parameters on the
    GPU (only the optimizer offloaded), ``-ratio`` keeps ``gpu_share`` of the optimizer's sub-groups and their
    update on the GPU, ``-nockpt`` runs without activation checkpointing."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    ratio = "-ratio" in system
    if ratio and gpu_share is None:
        raise ValueError(f"{system} needs the GPU's share of the update: --gpu-share, or a lazytrain row before it")
    offload_parameters = "-gpu-params" not in system
    sub_group = RATIO_SUB_GROUP if ratio else int(1e9)
    strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=offload_parameters,
                                 pin_memory=True, sub_group_size=sub_group, logging_batch_size_per_gpu=batch)
    note = f"pin_memory=True, zero.Init via configure_model, sub_group_size={sub_group:.0e}"
    if ratio:
        strategy.config["zero_optimization"]["offload_optimizer"]["ratio"] = 1.0 - gpu_share
        note += f", offload_optimizer.ratio={1.0 - gpu_share:.3f}"
    if not offload_parameters:
        note += ", parameters on the GPU"
    return SystemRun(ZeroInitModule(shape, system in CHECKPOINTED), strategy, "bf16-mixed", "DeepSpeedCPUAdam", clip,
                     note)


def gpu_update_share(strategy) -> float | None:
    """The share of the parameters whose optimizer update ran on the GPU: lazytrain's device units, DeepSpeed's
    sub-groups kept there, all for the GPU-resident runs, none for FSDP's CPU offload; None where unreadable."""
    executor = getattr(strategy, "executor", None)
    if executor is not None:
        device_queue = getattr(getattr(executor.path, "updates", None), "device_queue", None)
        on_device = sum(u.numel for u in device_queue.units) if device_queue is not None else 0
        return on_device / sum(u.numel for u in executor.store.units)
    optimizer = getattr(getattr(strategy, "deepspeed_engine", None), "optimizer", None)
    if optimizer is not None:
        where = getattr(optimizer, "subgroup_to_device", None)
        sizes = getattr(optimizer, "fp16_partitioned_groups_flat_numel", None)
        if where is None or not sizes:
            return None
        return sum(n for i, n in enumerate(sizes) if where[i] != "cpu") / sum(sizes)
    if type(strategy).__name__ == "FSDPStrategy":
        return 0.0 if strategy.cpu_offload.offload_params else 1.0
    return 1.0 if type(strategy).__name__ == "SingleDeviceStrategy" else None


class ZeroInitModule(BenchModule):
    """Builds its model in ``configure_model``, where Lightning's DeepSpeed strategy has zero.Init active, so the
    full model never exists in one place."""

    def __init__(self, shape: str, checkpointing: bool = True) -> None:
        super().__init__(None, "deepspeed")
        self.shape, self.checkpointing = shape, checkpointing

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(qwen_config(self.shape), dtype=torch.bfloat16)
        if self.checkpointing:
            model.gradient_checkpointing_enable()
        self.model = model


def rerun_share(cfg, seq: int) -> float:
    """The share of a layer's forward FLOPs that lazytrain's re-run in the backward executes: all but the MLP's
    output projection (`engine/compute/gradient_only_linear.py`), counted as ``model_flops_per_token`` counts a layer
    (2 FLOPs a weight, 4 x hidden x seq for the attention's mixing)."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads)
    weights = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    return 1.0 - 2 * hidden * inter / (2 * weights + 4 * hidden * seq)


def work_ratio(system: str, plan, rerun: float = 1.0) -> float:
    """Executed / model FLOPs of the decoder stack: forward + backward is 3 forwards' worth of work; every layer
    that does not keep its graph re-runs ``rerun`` of its forward with grad in the backward (``rerun_share``),
    and a recompute block re-runs its inner layers once more without grad."""
    if system in CHECKPOINTED:
        return 4 / 3
    if plan is None:
        return 1.0
    extra = sum(e - s - 1 for s, e in plan.blocks())
    reforward = plan.num_layers - plan.graph_layers
    return (3 * plan.num_layers + rerun * reforward + extra) / (3 * plan.num_layers)
