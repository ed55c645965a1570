"""One parameter's AdamW update on the GPU: the Triton kernel against the torch reference it replaced.

    python benchmarks/update_kernel_gpu.py --out benchmarks/results/update_kernel_<commit>_<machine>.json

For 8-bit and fp32 states, an fp32 master with a bf16 stream copy, 100M elements: the median of 10 updates after
2 warm-up ones, CUDA events around each. Also the bytes each update must move, to read the time as bandwidth.
Then the host's side: the main thread queues every device update (``engine/updates/device.py``), so the Python
time one ``fused_step`` call takes on a small parameter (``--launch-numel``), the median over 2000 calls in a row
with no synchronization between them, is what the main thread pays per parameter besides ``prepare_update``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from common import write_results

from lightning_lazytrain.optim.quant import quantize_blockwise
from lightning_lazytrain.optim.reference import reference_step, v_floor_coef
from lightning_lazytrain.optim.triton_adamw import fused_step


def _case(n: int, eight_bit: bool) -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor, dict]:
    p = torch.randn(n, device="cuda")
    g = (torch.randn(n, device="cuda") * 1e-2).to(torch.bfloat16)
    m, v = torch.randn(n, device="cuda") * 1e-3, torch.rand(n, device="cuda") * 1e-5
    if eight_bit:
        mc, ma = quantize_blockwise(m, True, 4096)
        vc, va = quantize_blockwise(v, False, 4096)
        state = {"exp_avg_codes": mc, "exp_avg_sq_codes": vc, "exp_avg_absmax": ma, "exp_avg_sq_absmax": va}
    else:
        state = {"exp_avg": m, "exp_avg_sq": v}
    scalars = dict(block=4096 if eight_bit else 1024, decay=1 - 1e-7, beta1=0.9, beta2=0.999, neg_step=-1e-4,
                   bc2_sqrt=0.1, eps=1e-8, grad_scale=0.5, sr_key=12345,
                   v_floor=v_floor_coef(0.9, 0.999, 10) if eight_bit else 0.0)
    return p, g, state, torch.empty(n, dtype=torch.bfloat16, device="cuda"), scalars


def _time(step, p, g, state, copy, scalars, warmup: int = 2, runs: int = 10) -> float:
    times = []
    for i in range(warmup + runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(param=p, grad=g, state=state, copy=copy, **scalars)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _launch_s(numel: int, calls: int = 2000) -> float:
    """Median host seconds of one ``fused_step`` call on a ``numel``-element parameter (8-bit states)."""
    p, g, state, copy, scalars = _case(numel, True)
    fused_step(param=p, grad=g, state=state, copy=copy, **scalars)  # compiled before timing
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fused_step(param=p, grad=g, state=state, copy=copy, **{**scalars, "sr_key": i})
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--launch-numel", type=int, default=1 << 20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for eight_bit in (True, False):
        p, g, state, copy, scalars = _case(args.numel, eight_bit)
        # read: grad 2, master 4, states (1+1 or 4+4); written: master 4, states, copy 2
        moved = args.numel * (2 + 4 + 4 + 2 + (4 if eight_bit else 16))
        for name, step in (("triton", fused_step), ("torch reference", reference_step)):
            s = _time(step, p, g, state, copy, scalars)
            rows.append({"kernel": name, "states": "8-bit" if eight_bit else "fp32", "numel": args.numel,
                         "median_s": s, "bytes_moved": moved, "gb_per_s": moved / s / 1e9})
            print(json.dumps(rows[-1]), flush=True)
    launch = {"kernel": "triton", "states": "8-bit", "numel": args.launch_numel,
              "host_s_per_call": _launch_s(args.launch_numel)}
    rows.append(launch)
    print(json.dumps(launch), flush=True)
    write_results(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
