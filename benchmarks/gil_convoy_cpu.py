"""What Python on side threads costs the main thread's torch calls: the GIL convoy, on the CPU.

The device share of the update used to be launched from two worker threads: per parameter a stretch of Python with
the GIL held (``prepare_update``, views, a Triton launch's argument binding) and then a call that drops it. The
main thread meanwhile queues the next step, thousands of small torch calls, each dropping the GIL and taking it
back. Each time it wants the GIL back it can wait for a worker's whole stretch, or up to the interpreter's switch
interval (5 ms). This times the main thread's calls alone, beside such workers, and after doing the workers'
Python itself (what ``engine/updates/device.py`` now does), with the same total Python work.

    python benchmarks/gil_convoy_cpu.py --out benchmarks/results/gil_convoy_<commit>_<machine>.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch
from common import write_results


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def launch_work(units: int, stretch_s: float) -> None:
    """One worker's share: per unit, Python with the GIL held, then a torch call that drops it."""
    y = torch.zeros(16)
    for _ in range(units):
        _spin(stretch_s)
        y.add_(1)


def main_calls(n: int) -> float:
    x = torch.zeros(16)
    start = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    return time.perf_counter() - start


def run(variant: str, calls: int, workers: int, units: int, stretch_s: float) -> float:
    """Seconds until the main thread has made its ``calls`` (and, inline, done the workers' Python first)."""
    if variant == "alone":
        return main_calls(calls)
    if variant == "inline":
        start = time.perf_counter()
        for _ in range(workers):
            launch_work(units, stretch_s)
        return time.perf_counter() - start + main_calls(calls)
    threads = [threading.Thread(target=launch_work, args=(units, stretch_s)) for _ in range(workers)]
    for t in threads:
        t.start()
    took = main_calls(calls)
    for t in threads:
        t.join()
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000, help="the main thread's torch calls")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--units", type=int, default=200, help="Python stretches per worker")
    parser.add_argument("--stretch-us", type=float, nargs="+", default=[20.0, 50.0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for stretch_us in args.stretch_us:
        for variant in ("alone", "threads", "inline"):
            times = [run(variant, args.calls, args.workers, args.units, stretch_us * 1e-6) for _ in range(args.repeats)]
            rows.append({"variant": variant, "stretch_us": stretch_us, "median_s": statistics.median(times),
                         "times_s": times, "workers_python_s": args.workers * args.units * stretch_us * 1e-6})
            print(f"{variant:8s} stretch {stretch_us:5.0f} us: {rows[-1]['median_s'] * 1e3:9.1f} ms")
    write_results(args.out, {"calls": args.calls, "workers": args.workers, "units": args.units,
                             "switch_interval_s": sys.getswitchinterval(), "rows": rows})


if __name__ == "__main__":
    main()
