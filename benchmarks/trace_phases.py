"""Where a profiled step's GPU time went, from the trace ``profile_step_gpu.py`` wrote.

    python benchmarks/trace_phases.py <out>.trace.json.gz --out benchmarks/results/trace_phases_<name>.json

Per CUDA stream: kernels, busy and span milliseconds. For the head loss (the kernels launched while the CPU op
``_ChunkedHeadLoss`` ran, matched by correlation id; cuBLAS's driver-API launches are not matched, so the head's
matmuls are in its span but not in its busy time): the span on the compute stream, and its kernels by name.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json

from common import write_results


def _kernels(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def streams(kernels: list[dict]) -> dict:
    by_stream = collections.defaultdict(list)
    for e in kernels:
        by_stream[e["args"].get("stream")].append(e)
    out = {}
    for stream, ks in by_stream.items():
        ks.sort(key=lambda e: e["ts"])
        out[str(stream)] = {"kernels": len(ks), "busy_ms": sum(e["dur"] for e in ks) / 1e3,
                            "span_ms": (ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]) / 1e3}
    return out


def head_loss(events: list[dict], kernels: list[dict]) -> dict | None:
    ops = [e for e in events if e.get("ph") == "X" and e.get("name") == "_ChunkedHeadLoss"]
    if not ops:
        return None
    op = max(ops, key=lambda e: e["dur"])
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    inside = [k for k in kernels
              if op["ts"] <= launches.get(k["args"].get("correlation"), -1) <= op["ts"] + op["dur"]]
    if not inside:
        return None
    inside.sort(key=lambda e: e["ts"])
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for k in inside:
        row = by_name[k["name"][:120]]
        row[0] += 1
        row[1] += k["dur"] / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    return {"gpu_span_ms": (inside[-1]["ts"] + inside[-1]["dur"] - inside[0]["ts"]) / 1e3,
            "runtime_launched_busy_ms": sum(k["dur"] for k in inside) / 1e3,
            "top": [{"name": n, "calls": c, "ms": ms} for n, (c, ms) in top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with gzip.open(args.trace) as f:
        trace = json.load(f)
    events, kernels = trace["traceEvents"], _kernels(trace["traceEvents"])
    # "machine" in the file is where this script ran; the trace names the GPU it was taken on
    device = (trace.get("deviceProperties") or [{}])[0].get("name")
    row = {"trace": args.trace, "trace_device": device, "streams": streams(kernels),
           "head_loss": head_loss(events, kernels)}
    write_results(args.out, {"rows": [row]})
    print(json.dumps(row, indent=1)[:3000])


if __name__ == "__main__":
    main()
