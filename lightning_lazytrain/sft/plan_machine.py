"""Which device ``lazytrain plan`` plans for, and where its layer times come from.

``--gpu NAME`` plans for that GPU (measured here when it is the GPU here, else scaled or analytic); without it, the
GPU here. A run on the CPU (``trainer.accelerator: cpu``, as the demo's, or no CUDA device with the accelerator
left to Lightning) is planned for the CPU device as ``fit`` runs it there: the layers compute in host RAM, times
are analytic at the fp32 matmul rate this CPU reaches, and copies at the rate it copies memory. Everywhere the
layers' streamed bytes are the run's (``RunSpec.counts``: a 4-bit base as its packed codes and quant state), and a
LoRA model's frozen layers compute no weight gradients (`schedule/layer_backward.py`).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from lightning_lazytrain.schedule.analytic import ACHIEVED_FRACTION, analytic_profile, scale_profile
from lightning_lazytrain.schedule.forecast import RunSpec
from lightning_lazytrain.schedule.gpus import GPUS, GpuSpec, gpu_spec, spec_for_device
from lightning_lazytrain.schedule.profile import Profile

ProfileFor = Callable[[int], Profile]
CPU_SIDE = 1024  # the matmul that times the CPU: 2 GFLOP, tens of milliseconds on a laptop core
COPY_BYTES = 64 << 20  # the copy that times host memory


def _best_seconds(work: Callable[[], object], repeats: int = 3) -> float:
    work()  # warm-up: first-touch page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_rates() -> tuple[float, float]:
    """(fp32 matmul FLOP/s, memory copy bytes/s) of this CPU, each the best of a few short runs."""
    a = torch.randn(CPU_SIDE, CPU_SIDE)
    flops = 2.0 * CPU_SIDE**3 / _best_seconds(lambda: a @ a)
    src = torch.empty(COPY_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return flops, COPY_BYTES / _best_seconds(lambda: dst.copy_(src))


def plans_the_cpu(gpu_name: str | None, accelerator: object) -> bool:
    """Whether the plan is for the CPU device: no ``--gpu``, and the run would train on the CPU."""
    if gpu_name is not None:
        return False
    return accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())


def cpu_machine(run: RunSpec, host_available_bytes: int, accelerator: object) -> tuple[GpuSpec, ProfileFor, str]:
    """The CPU as the device: its memory is the host RAM available (the same RAM the host tier counts), no peak
    (no MFU is printed), analytic layer times at this CPU's matmul rate and copies at its memory copy rate."""
    flops, copy = cpu_rates()
    name = platform.processor() or platform.machine()
    spec = GpuSpec("cpu", f"{name}, {os.cpu_count()} cores, the host RAM", host_available_bytes, 0.0, 5)
    timed = replace(spec, bf16_tflops=flops / 1e12)
    scaling = (
        f"analytic: layer FLOPs at {ACHIEVED_FRACTION:.2f} of the {flops / 1e9:.4g} GFLOP/s a {CPU_SIDE}^2 "
        f"fp32 matmul reached on this CPU; copies at its {copy / 1e9:.1f} GB/s memory copy rate"
    )

    def profile_for(batch: int) -> Profile:
        profile = analytic_profile(run.adapter, batch, run.seq, timed, run.stream_dtype, fused=run.kernels_fused,
                                   layer_bytes=run.counts.layer_stream_bytes)
        profile = replace(profile, h2d_bytes_per_s=copy, d2h_bytes_per_s=copy, duplex_bytes_per_s=copy)
        profile.info["scaling"] = scaling
        return profile

    why = "trainer.accelerator=cpu" if accelerator == "cpu" else "no CUDA device here and no --gpu"
    return spec, profile_for, f"{why}: planned for the CPU device, as fit runs on it; --gpu NAME plans for a GPU"


def gpu_machine(gpu_name: str | None, run: RunSpec) -> tuple[GpuSpec, ProfileFor, str]:
    """(GpuSpec to plan for, profile function, words for the source)."""
    here = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    measured_spec = spec_for_device(here) if here else None
    if gpu_name is None and here is None:
        raise ValueError(
            f"trainer.accelerator asks for a GPU and there is no CUDA device here: name the GPU to plan"
            f" for with --gpu ({', '.join(GPUS)}), or plan the CPU with --trainer.accelerator cpu"
        )
    if gpu_name is None:
        total = torch.cuda.get_device_properties(0).total_memory
        spec = GpuSpec("this GPU", here, total, measured_spec.bf16_tflops if measured_spec else 0.0, 5)
        return spec, lambda b: _measured(run, b), f"the GPU here ({here})"
    spec = gpu_spec(gpu_name)
    if measured_spec is not None:
        if measured_spec.name == spec.name:
            return spec, lambda b: _measured(run, b), f"--gpu {spec.name}, measured here"
        ratio_from = measured_spec.bf16_tflops
        return spec, lambda b: scale_profile(_measured(run, b), ratio_from, spec), f"--gpu {spec.name}"
    return (
        spec,
        lambda b: analytic_profile(run.adapter, b, run.seq, spec, run.stream_dtype, fused=run.kernels_fused,
                                   layer_bytes=run.counts.layer_stream_bytes),
        f"--gpu {spec.name}",
    )


def _measured(run: RunSpec, batch: int) -> Profile:
    from lightning_lazytrain.schedule.device_profile import measured_profile

    return measured_profile(
        run.adapter, batch, run.seq, torch.device("cuda", 0), run.stream_dtype, fused=run.kernels_fused,
        layer_bytes=run.counts.layer_stream_bytes,
    )
