"""The CPU update's throughput while the link copies: does host DMA traffic slow the 8-bit AdamW?

    python benchmarks/update_under_dma_gpu.py --out $OUT/results/update_under_dma_h200.json

At P5 (7B, 24 GiB cap, batch 32) Liger's smaller graphs let the plan move boundaries to CPU homes (25 against 18)
and the CPU update's busy time went 1.40 -> 2.57 s for the same parameters (``suite_p5_c17ab17_h200.json``). The update
streams about 16 bytes a parameter through host memory; pinned copies to and from the GPU use the same memory. This
times ``HybridAdamW.step_params`` (8-bit states, bf16 gradients, clip, bf16 stream copy: the engine's call) on the
same tensors alone and while a thread keeps device-to-host, host-to-device or both kinds of 256 MiB pinned copies
queued, and with fewer update threads than cores (the main thread and the copy thread then have their own).
Each case: median of ``--repeats`` steps after one warm-up; the copies' achieved GB/s is measured over the case.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch
from common import default_out, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_lazytrain.optim import HybridAdamW  # noqa: E402

CHUNK = 256 << 20


class CopyLoad(threading.Thread):
    """Keeps pinned copies in one or both directions queued until stopped; counts the bytes that landed."""

    def __init__(self, directions: tuple[str, ...]) -> None:
        super().__init__(daemon=True)
        self.directions, self.stop, self.bytes = directions, threading.Event(), 0
        self.host = {d: torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for d in directions}
        self.dev = {d: torch.empty(CHUNK, dtype=torch.uint8, device="cuda") for d in directions}
        self.streams = {d: torch.cuda.Stream() for d in directions}

    def run(self) -> None:
        while not self.stop.is_set():
            for d in self.directions:
                with torch.cuda.stream(self.streams[d]):
                    for _ in range(4):
                        if d == "d2h":
                            self.host[d].copy_(self.dev[d], non_blocking=True)
                        else:
                            self.dev[d].copy_(self.host[d], non_blocking=True)
            for d in self.directions:
                self.streams[d].synchronize()
                self.bytes += 4 * CHUNK


def _case(name: str, step, directions: tuple[str, ...], repeats: int, numel: int) -> dict:
    load = CopyLoad(directions) if directions else None
    step()
    if load is not None:
        load.start()
        time.sleep(0.2)
    start_bytes, start = (load.bytes if load else 0), time.perf_counter()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    copied = (load.bytes - start_bytes) if load else 0
    if load is not None:
        load.stop.set()
        load.join()
    median = sorted(times)[len(times) // 2]
    row = {"case": name, "copies": list(directions), "update_s": round(median, 4),
           "g_params_per_s": round(numel / median / 1e9, 3), "copy_gb_per_s": round(copied / elapsed / 1e9, 2),
           "update_s_each": [round(t, 4) for t in times]}
    print(f"{name:28s} {row['update_s']:7.3f} s  {row['g_params_per_s']:6.2f} G params/s  "
          f"copies {row['copy_gb_per_s']:6.1f} GB/s", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=float, default=233e6, help="elements per tensor (one 7B decoder layer's worth)")
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/update_under_dma_<commit>_<machine>.json")
    args = ap.parse_args()
    args.out = args.out or default_out("update_under_dma")
    torch.manual_seed(0)
    shapes = [int(args.numel)] * args.tensors
    params = [(torch.randn(n) * 0.02).requires_grad_(True) for n in shapes]
    grads = [(torch.randn(n) * 1e-3).to(torch.bfloat16) for n in shapes]
    copies = [torch.empty(n, dtype=torch.bfloat16, pin_memory=True) for n in shapes]
    cores = len(os.sched_getaffinity(0))
    rows = []
    for threads in (cores, cores - 2):
        opt = HybridAdamW(params, lr=1e-4, eight_bit_fraction=1.0, num_threads=threads)
        for p, c in zip(params, copies, strict=True):
            opt.register_stream_copy(p, c)

        def step(opt=opt) -> None:
            opt.step_params(params, 0.5, grads)

        for directions in ((), ("d2h",), ("h2d",), ("d2h", "h2d")):
            name = f"{threads} threads, " + ("+".join(directions) or "alone")
            rows.append({"threads": threads, **_case(name, step, directions, args.repeats, sum(shapes))})
        opt.state.clear()
    write_results(args.out, {"numel": sum(shapes), "cores": cores, "rows": rows})


if __name__ == "__main__":
    main()
