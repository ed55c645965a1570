"""A `Profile` and the device's fixed parts from the model's shapes alone, for a GPU that is not here.

Per-layer time is the layer's forward FLOPs (2 x parameters x tokens + the attention's token mixing) over an
achieved rate, ``ACHIEVED_FRACTION`` of the GPU's published dense bf16 peak. The fraction is what the H200 reached
in a streamed step: Qwen2.5-7B shape, batch 64 x 1024, 80 GiB cap, 6.40 s of GPU compute (step minus host waits)
for 3.68e15 executed FLOPs = 575 TFLOP/s of 989 (benchmarks/results/archive/h200.json, commit a0fe04b). Smaller matmuls
reach less of the peak, so at small batches the prediction is optimistic.

A layer's backward is its input gradients through every weight and the weight gradients of the trainable ones
only (`layer_backward.py`): twice its forward when all train, about once for a frozen LoRA base layer; its
gradient bytes back are its trainable weights'. Streamed bytes are the store's (``layer_bytes``: the plan's count
of a 4-bit base, `frozen_base.py`).

Per-layer graph, working-set and MLP-re-run bytes are the estimates `profile_model` uses off CUDA
(`layer_memory.analytic_layer_estimates`), the MLP's seconds at the same achieved rate; so the MILP can keep graphs
and re-run MLPs here as it does in the run. `gpu_layout` gives the weight slot and the resident parts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from lightning_lazytrain.models.adapter import ModelAdapter
from lightning_lazytrain.models.fused_kernels import UNFUSED, FusedParts, fusable

from .gpus import GpuSpec
from .layer_backward import backward_ratio, flop_numel, streamed_bytes
from .layer_memory import analytic_layer_estimates, output_projection_seconds, trainable_bytes
from .profile import SOURCE_KEYS, Profile, _attention_flops, head_flops

ACHIEVED_FRACTION = 0.58
# a layer with Liger's norms and SwiGLU (``models/fused_kernels.py``) re-runs its forward in this share of HF's time:
# 0.90-0.92 at batches 16-144 on an H200, 7B shape (benchmarks/results/layer_kernels_c17ab17_h200.json, "fwd_nograd_ms")
FUSED_LAYER_TIME = 0.91
# and with Liger's RoPE too, this share of that: 0.93 at batches 64 and 144, 0.96 at 16 (the same file, "liger+rope")
FUSED_ROPE_TIME = 0.93
DISK_READ, DISK_WRITE = 1.28e9, 0.51e9  # REFERENCE.md: the H200 machine's disk (no spill dir to measure)


def _fused_speed(parts: FusedParts) -> float:
    # only the measured layer (dense, norms and SwiGLU fused) is scaled: in an MoE layer the experts dominate
    if not (parts.norms and parts.mlp):
        return 1.0
    return FUSED_LAYER_TIME * (FUSED_ROPE_TIME if parts.rope else 1.0)


def model_flops_per_step(num_params: int, num_layers: int, hidden: int, batch: int, seq: int,
                         frozen_params: int = 0) -> float:
    """The model FLOPs TFLOPS figures count: (6 N + 12 layers hidden seq) per token (REFERENCE.md); the
    ``frozen_params`` among the ``num_params`` count 4 (forward and input gradient, no weight gradient), as issue
    38 counts LoRA: (4 N_frozen + 6 N_adapters + 12 layers hidden seq) per token."""
    return (6.0 * num_params - 2.0 * frozen_params + 12.0 * num_layers * hidden * seq) * batch * seq


def analytic_profile(
    adapter: ModelAdapter,
    batch: int,
    seq: int,
    gpu: GpuSpec,
    stream_dtype: torch.dtype = torch.bfloat16,
    achieved_fraction: float = ACHIEVED_FRACTION,
    fused: bool = False,
    layer_bytes: list[int] | None = None,
) -> Profile:
    """The profile ``profile_model`` would measure on ``gpu``, from FLOPs and the published figures; ``fused``: the
    run binds Liger's kernels where a layer allows (smaller graphs; a layer with fused parts runs faster);
    ``layer_bytes``: each layer's streamed bytes where the meta model does not hold them as the run will (a 4-bit
    base, ``RunSpec.counts``), else the layers' own.

    Works on a model built on the meta device (only shapes are read).
    """
    config = adapter.model.config
    itemsize = stream_dtype.itemsize
    tokens, types = batch * seq, adapter.layer_types()
    rate = gpu.bf16_tflops * 1e12 * achieved_fraction
    layers = list(adapter.layers)
    numel = [flop_numel(layer) for layer in layers]
    mixing = [_attention_flops(config, types[j], batch, seq) for j in range(adapter.num_layers)]
    parts = [fusable(layer) if fused else UNFUSED for layer in layers]
    speed = [_fused_speed(p) for p in parts]
    forward = [speed[j] * (2.0 * numel[j] * tokens + mixing[j]) / rate for j in range(adapter.num_layers)]
    backward = [backward_ratio(layer, mixing[j], tokens) * forward[j] for j, layer in enumerate(layers)]
    rerun = [f - d for f, d in zip(forward, output_projection_seconds(adapter, tokens, rate))]
    head = head_flops(adapter, tokens) / rate
    act = batch * seq * config.hidden_size * itemsize
    scaling = (
        f"analytic: layer FLOPs / {rate / 1e12:.0f} TFLOP/s ({achieved_fraction:.2f} of {gpu.name}'s "
        f"{gpu.bf16_tflops:g} dense bf16 peak); link PCIe gen{gpu.pcie_gen} x16 at the H200's measured share"
    )
    if any(any(p) for p in parts):
        scaling += (f"; Liger's fused norm and SwiGLU where a layer allows (x{FUSED_LAYER_TIME} layer time), "
                    f"and its RoPE (x{FUSED_ROPE_TIME} more)")
    if itemsize > 2:
        scaling += f"; fp32 layers run below the bf16 rate, so these {str(stream_dtype)[6:]} times are too short"
    return Profile(
        forward_seconds=forward,
        rerun_seconds=rerun,
        activation_bytes=[act] * (adapter.num_layers + 1),
        param_bytes=layer_bytes if layer_bytes is not None else [streamed_bytes(layer, itemsize) for layer in layers],
        backward_seconds=backward,
        grad_bytes=[trainable_bytes(layer, itemsize) for layer in layers],
        head_seconds=head,
        h2d_bytes_per_s=gpu.h2d_bytes_per_s,
        d2h_bytes_per_s=gpu.d2h_bytes_per_s,
        duplex_bytes_per_s=gpu.duplex_bytes_per_s,
        nvme_read_bytes_per_s=DISK_READ,
        nvme_write_bytes_per_s=DISK_WRITE,
        device_name=gpu.description,
        sources=dict.fromkeys(SOURCE_KEYS, "analytic"),
        batch=batch,
        seq=seq,
        dtype=str(stream_dtype).replace("torch.", ""),
        layer_types=types,
        **asdict(analytic_layer_estimates(adapter, tokens, itemsize, rate, fused)),
        info={"scaling": scaling, "achieved_tflops": rate / 1e12},
    )


def scale_profile(profile: Profile, measured_tflops: float, gpu: GpuSpec) -> Profile:
    """A profile measured on a GPU of ``measured_tflops`` peak, carried over to ``gpu``: times scaled by the ratio
    of the dense bf16 peaks, the link replaced by ``gpu``'s."""
    ratio = measured_tflops / gpu.bf16_tflops
    scaling = (
        f"measured on {profile.device_name}, times x {ratio:.3f} ({measured_tflops:g} / {gpu.bf16_tflops:g} "
        f"dense bf16 TFLOPS of {gpu.name}); link PCIe gen{gpu.pcie_gen} x16 at the H200's measured share"
    )
    return replace(
        profile,
        forward_seconds=[f * ratio for f in profile.forward_seconds],
        backward_seconds=[f * ratio for f in profile.backward_seconds],
        mlp_seconds=[f * ratio for f in profile.mlp_seconds],
        rerun_seconds=[f * ratio for f in profile.rerun_seconds],
        head_seconds=profile.head_seconds * ratio,
        h2d_bytes_per_s=gpu.h2d_bytes_per_s,
        d2h_bytes_per_s=gpu.d2h_bytes_per_s,
        duplex_bytes_per_s=gpu.duplex_bytes_per_s,
        device_name=gpu.description,
        sources={**profile.sources, "h2d": "analytic", "d2h": "analytic", "duplex": "analytic"},
        info={**profile.info, "scaling": scaling},
    )


@dataclass(frozen=True)
class GpuLayout:
    """A weight slot's bytes (the plan counts its slots) and the resident parts the device holds outside the plan.

    ``slot_bytes``: one weight slot (the largest layer as the store streams it; the forecast takes
    ``RunSpec.slot_bytes``, which also counts a 4-bit base the meta model does not hold). ``resident_copy_bytes``:
    the device copy of embeddings, final norm and head in the stream dtype, which the executor allocates at setup,
    before the planner measures the free memory (`planning.solve.device_plan_bytes`). Their gradients come later,
    in the backward, and the plan does not count them (docs/plan.md, "Not modelled").
    """

    slot_bytes: int
    resident_copy_bytes: int


def gpu_layout(adapter: ModelAdapter, stream_dtype: torch.dtype = torch.bfloat16) -> GpuLayout:
    itemsize = stream_dtype.itemsize
    slot = max(streamed_bytes(layer, itemsize) for layer in adapter.layers)
    layer_ids = {id(p) for layer in adapter.layers for p in layer.parameters()}
    resident = sum(p.numel() for p in {id(p): p for p in adapter.model.parameters()}.values() if id(p) not in layer_ids)
    return GpuLayout(slot_bytes=slot, resident_copy_bytes=resident * itemsize)
