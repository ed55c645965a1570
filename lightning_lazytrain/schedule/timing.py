"""Timing one call of the profiled code: CUDA events on the device, the wall clock elsewhere; rotary inputs."""

from __future__ import annotations

import time

import torch


def rotary_inputs(rotary: torch.nn.Module, h: torch.Tensor, batch: int, seq: int):
    pos = torch.arange(seq, device=h.device).unsqueeze(0).expand(batch, -1)
    try:
        return pos, rotary(h, pos)
    except Exception:  # multimodal RoPE (Qwen3.5 in transformers 5.17) wants 3 rows of position ids
        pos3 = pos.unsqueeze(0).expand(3, -1, -1)
        return pos3, rotary(h, pos3)


def time_cuda(fn, device: torch.device, warm: int = 2, reps: int = 3) -> float:
    """Seconds per call of ``fn``: events around ``reps`` back-to-back calls, no synchronize inside the loop."""
    for _ in range(warm):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream(device)
    start.record(stream)
    for _ in range(reps):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def time_wall(fn, device: torch.device, warm: int = 1, reps: int = 2) -> float:
    """Wall-clock stand-in for `time_cuda` (CPU runs of the measuring code in tests)."""
    for _ in range(warm):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps
