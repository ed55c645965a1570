"""One training step of a bench system under ``torch.profiler`` (CPU and CUDA, every thread), after warm-up.

The device share of the updates ran 0.9 s a step longer than the CPU path at 3B batch 8 on an H100, with the layers'
GPU span only 0.54 s and no update wait measured (``results/archive/ab_3b_fused_bitwise_178dc78_h100.json``): the time
is spent between steps or in a thread the step timer does not see. A trace from one batch start to the next shows where.

    python benchmarks/profile_step_gpu.py --system lazytrain-gpu-updates-plan --out $OUT/profile_plan
    python benchmarks/profile_step_gpu.py --system lazytrain --out $OUT/profile_cpu
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    python benchmarks/profile_step_gpu.py --system lazytrain --shape qwen2.5-7b --batch 144 --cap-gib 80 \
        --warmup 1 --out $OUT/profile_7b_b144     # where the paper batch's 2.2 s outside the stack go

writes ``<out>.trace.json.gz`` (open in Perfetto) and ``<out>.json``: the step's wall time, the busiest operators by
self CPU and self CUDA time, each thread's summed top-level CPU time, and where each thread's Python was, sampled
every 5 ms (the profiler shows operators, not the Python between them, nor what a thread waited in). The sampler
holds the GIL while it reads the stacks, so it reads only each thread's innermost frames, and not often.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import sys
import threading
import time

import torch
from common import GPU, RandomTokens, StepTimer, cap_gpu_memory, qwen_config, run_fit, write_results
from systems import SYSTEMS, build

import lightning_lazytrain

SEQ = 1024


class StackSampler(threading.Thread):
    """Every ``period_s``, the innermost frames of every other thread's Python stack; ``summary()`` counts them."""

    def __init__(self, period_s: float = 5e-3, depth: int = 7) -> None:
        super().__init__(daemon=True)
        self.period_s, self.depth = period_s, depth
        self.samples: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stop_event = threading.Event()

    def run(self) -> None:
        names = {}
        while not self._stop_event.wait(self.period_s):
            for ident, frame in sys._current_frames().items():
                if ident == self.ident:
                    continue
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                self.samples[names.get(ident, str(ident))][self._innermost(frame)] += 1

    def _innermost(self, frame) -> str:
        names = []
        while frame is not None and len(names) < self.depth:
            names.append(f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})")
            frame = frame.f_back
        return " < ".join(names)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def summary(self, top: int = 20) -> dict:
        return {thread: {"samples": sum(c.values()), "top": c.most_common(top)} for thread, c in self.samples.items()}


def _sync() -> None:
    if GPU:
        torch.cuda.synchronize()


class ProfiledStep(StepTimer):
    """Profiles from the start of batch ``at`` to the start of the next one."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.prof, self.wall_s = at, None, None
        self.sampler = StackSampler()
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at + 1 and self.prof is not None:
            _sync()
            self.wall_s = time.perf_counter() - self._t0
            self.prof.stop()
            self.sampler.stop()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if batch_idx == self.at:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if GPU else [])
            self.prof = torch.profiler.profile(activities=acts, with_stack=False, record_shapes=False)
            _sync()
            self._t0 = time.perf_counter()
            self.prof.start()
            self.sampler.start()


def _top(prof, key: str, n: int = 30) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "cpu_total_ms": e.cpu_time_total / 1e3, "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3}
            for e in rows]


def _threads(prof) -> dict:
    """Summed CPU time of each thread's outermost operators (nested ones are inside them)."""
    by_thread: dict[int, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None:
            by_thread.setdefault(e.thread, []).append(e.time_range.elapsed_us())
    return {str(t): {"top_level_ops": len(v), "cpu_ms": sum(v) / 1e3} for t, v in by_thread.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", choices=SYSTEMS, default="lazytrain-gpu-updates-plan")
    parser.add_argument("--shape", default="qwen2.5-3b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps before the profiled one")
    parser.add_argument("--cap-gib", type=float, default=None, help="GPU memory cap, as the suite's rows set it")
    parser.add_argument("--out", required=True, help="path prefix of the two files written")
    args = parser.parse_args()
    if args.cap_gib is not None:
        cap_gpu_memory(args.cap_gib)
    run = build(args.system, args.shape, args.batch, {})
    timer = ProfiledStep(args.warmup)
    data = RandomTokens(args.warmup + 2, args.batch, SEQ, qwen_config(args.shape).vocab_size)
    run_fit(run.module, run.strategy, run.precision, data, timer, **run.trainer_kw)
    prof = timer.prof
    trace = args.out + ".trace.json"
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)
    summary = {"library": os.path.dirname(lightning_lazytrain.__file__),
               "system": args.system, "shape": args.shape, "batch": args.batch, "profiled_step_wall_s": timer.wall_s,
               "top_self_cpu": _top(prof, "self_cpu_time_total"),
               "top_self_device": _top(prof, "self_device_time_total"), "threads": _threads(prof),
               "python_stacks": timer.sampler.summary()}
    write_results(args.out + ".json", summary)
    print(json.dumps({k: summary[k] for k in ("library", "system", "profiled_step_wall_s", "threads")}, default=str))
    for thread, seen in summary["python_stacks"].items():
        print(f"{thread}: {seen['samples']} samples")
        for stack, count in seen["top"][:10]:
            print(f"  {count:5d}  {stack[:400]}")


if __name__ == "__main__":
    main()
