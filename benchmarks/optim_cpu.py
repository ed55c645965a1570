"""CPU optimizer-update throughput (G params/s): torch AdamW fused/foreach, bitsandbytes AdamW8bit, HybridAdamW.

Usage: python benchmarks/optim_cpu.py [--out FILE] [--numel 50e6 --tensors 4]
Every optimizer updates the same tensors (fp32 params, fp32 grads; HybridAdamW also with bf16 grads and a bf16
stream copy, the engine's configuration). ``--rounds`` times over all optimizers in turn (so a load change on a
shared machine hits them all alike), each: build it, one warm-up step, ``--repeats`` timed steps; the result is
the median of all timed steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_lazytrain.optim import HybridAdamW  # noqa: E402
from lightning_lazytrain.optim.kernel import fast_encoder, kernel_path  # noqa: E402


def _cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _commit() -> str:
    if os.environ.get("LAZYTRAIN_COMMIT"):  # a copied working tree (the device machine) may carry a stale .git
        return os.environ["LAZYTRAIN_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]
        cmd = ["git", "-C", str(root), "rev-parse", "HEAD"]
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def _time(step, repeats: int) -> list[float]:
    step()  # warm-up: allocates lazy state, builds nothing (kernels are built at construction)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: benchmarks/results/optim_cpu_<commit>_cpu<cores>.json")
    ap.add_argument("--numel", type=float, default=48e6, help="elements per large tensor")
    ap.add_argument("--tensors", type=int, default=4, help="number of large tensors")
    ap.add_argument("--small", type=int, default=8, help="extra 1M-element tensors (so fraction 0.02 selects some)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per optimizer and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-bnb", action="store_true")
    args = ap.parse_args()
    from results_index import result_path  # beside this script

    args.out = args.out or result_path("optim_cpu", f"cpu{os.cpu_count()}")
    torch.manual_seed(0)
    shapes = [int(args.numel)] * args.tensors + [1 << 20] * args.small
    params = [torch.randn(n) * 0.02 for n in shapes]
    grads32 = [torch.randn(n) * 1e-3 for n in shapes]
    total = sum(shapes)
    results: dict[str, float] = {}
    notes: dict[str, str] = {}

    cases: list[tuple[str, object, list[torch.Tensor], bool]] = []
    step_times: dict[str, list[float]] = {}

    def measure(name: str, make, grads=grads32, engine=False) -> None:
        cases.append((name, make, grads, engine))

    def run_case(name: str, make, grads, engine) -> None:
        ps = [p.clone().requires_grad_(True) for p in params]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g if g.dtype == p.dtype else None
        opt = make(ps)
        if engine:
            copies = [torch.empty(p.shape, dtype=torch.bfloat16) for p in ps]
            for p, c in zip(ps, copies, strict=True):
                opt.register_stream_copy(p, c)
            step = lambda: opt.step_params(ps, 0.5, grads)
        else:
            step = opt.step
        step_times.setdefault(name, []).extend(_time(step, args.repeats))
        opt.state.clear()  # free the states before the next optimizer allocates its own
        gc.collect()

    measure("torch_adamw_fused_fp32", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))
    measure("torch_adamw_foreach_fp32", lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True))
    measure("torch_adamw_single_tensor_fp32", lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False))
    if not args.skip_bnb:
        try:
            import bitsandbytes as bnb

            # bnb on the CPU is ~70x slower; time a slice of the tensors and scale to params/s.
            sub = [params[0][: 1 << 22].clone().requires_grad_(True)]
            sub[0].grad = grads32[0][: 1 << 22].clone()
            opt = bnb.optim.AdamW8bit(sub, lr=1e-4)
            sec = _median(_time(opt.step, 2))
            results["bnb_adamw8bit_cpu"] = round(sub[0].numel() / sec / 1e9, 4)
            notes["bnb_adamw8bit_cpu"] = "timed on one 4M-element tensor"
            print(f"{'bnb_adamw8bit_cpu':48s} {results['bnb_adamw8bit_cpu']:8.3f} G params/s", flush=True)
        except Exception as e:  # noqa: BLE001 - a missing/broken bnb CPU backend is a result, not a crash
            notes["bnb_adamw8bit_cpu"] = f"failed: {type(e).__name__}: {e}"
    for frac in (0.0, 0.02, 1.0):
        measure(f"hybrid_frac{frac:g}_fp32grad", lambda ps, f=frac: HybridAdamW(ps, lr=1e-4, eight_bit_fraction=f))
    grads16 = [g.to(torch.bfloat16) for g in grads32]
    for frac in (0.0, 0.02, 1.0):
        measure(
            f"hybrid_frac{frac:g}_bf16grad_clip_streamcopy",
            lambda ps, f=frac: HybridAdamW(ps, lr=1e-4, eight_bit_fraction=f),
            grads=grads16,
            engine=True,
        )
    for r in range(args.rounds):
        for case in cases:
            run_case(*case)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    spread: dict[str, list[float]] = {}
    for name, _, _, _ in cases:
        sec = _median(step_times[name])
        results[name] = round(total / sec / 1e9, 4)
        spread[name] = [round(total / max(step_times[name]) / 1e9, 4), round(total / min(step_times[name]) / 1e9, 4)]
        print(f"{name:48s} {results[name]:8.3f} G params/s  ({sec * 1e3:.1f} ms/step)", flush=True)
    probe = HybridAdamW([p.clone() for p in params], eight_bit_fraction=0.02)
    realised = sum(p.numel() for group in probe.param_groups for p in group["params"] if probe.is_8bit(p)) / total
    del probe
    fused = results["torch_adamw_fused_fp32"]
    out = {
        "command": " ".join([sys.executable, *sys.argv]),
        "git_commit": _commit(),
        "machine": {
            "nproc": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cpu_model": _cpu_model(),
            "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(),
            # which 8-bit kernel path ran: the one-loop AVX-512 path needs VBMI and the table-driven encoder
            "avx512_vbmi": "avx512vbmi" in _cpu_flags(),
            "fast_encoder": fast_encoder(),
            "kernel_path": kernel_path(),
        },
        "tensors": {"large_numel": int(args.numel), "large": args.tensors, "small_1M": args.small, "total": total},
        "realised_8bit_fraction_at_0.02": round(realised, 4),
        "timing": {"rounds": args.rounds, "timed_steps_per_round": args.repeats, "statistic": "median step"},
        "g_params_per_s": results,
        "speedup_vs_fused_fp32": {k: round(v / fused, 3) for k, v in results.items()},
        "slowest_fastest_step_g_params_per_s": spread,
        "notes": notes,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
