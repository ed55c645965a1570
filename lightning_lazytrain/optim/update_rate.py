"""HybridAdamW's CPU update rate on this host, measured once and cached: what ``lazytrain plan`` forecasts the
update time with (the rate differs 20x between the kernel's paths, so no one constant fits every host).

The measurement: a few steps on a scratch tensor in the engine's configuration (bf16 gradient, clip coefficient,
bf16 stream copy), the fastest of 3 after a warm-up, on the kernel path this host runs. Cached in
``$LAZYTRAIN_CACHE/update_rate.json`` (default ``~/.cache/lightning_lazytrain``) per path, thread count, state
kind and CPU, so a host measures each once.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from .hybrid_adamw import HybridAdamW
from .kernel import _cpu_flags as cpu_flags
from .kernel import kernel_path

__all__ = ["host_update_rate", "time_update"]

_NUMEL = 1 << 22  # 4 M parameters: about 10 ms a step on the vector paths, 0.7 s on the scalar path's 8-bit


def time_update(eight_bit: bool, threads: int | None, numel: int = _NUMEL) -> float:
    """Parameters per second of one HybridAdamW update with fp32 or 8-bit states (fastest of 3 timed steps), in the
    engine's configuration: bf16 gradient, clip coefficient, bf16 stream copy; ``threads`` None is the optimizer's
    default."""
    param = torch.zeros(numel)
    opt = HybridAdamW([param], lr=1e-6, eight_bit_fraction=1.0 if eight_bit else 0.0, num_threads=threads)
    opt.register_stream_copy(param, torch.empty(numel, dtype=torch.bfloat16))
    grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16)
    opt.step_params([param], 0.5, [grad])
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        opt.step_params([param], 0.5, [grad])
        best = min(best, time.perf_counter() - start)
    return numel / best


def _cache_file() -> Path:
    return Path(os.environ.get("LAZYTRAIN_CACHE", Path.home() / ".cache" / "lightning_lazytrain")) / "update_rate.json"


def host_update_rate(eight_bit_fraction: float, threads: int | None = None) -> tuple[float, str]:
    """(parameters per second, kernel path) of HybridAdamW's CPU update here with ``eight_bit_fraction`` of the
    parameters in 8-bit states: the time per parameter is the fraction's mix of the two measured rates."""
    threads = threads or torch.get_num_threads()
    path = kernel_path()
    cache = _cache_file()
    try:
        rates = json.loads(cache.read_text())
    except (OSError, ValueError):
        rates = {}
    cpu = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]  # a home shared across machines
    seconds = 0.0
    for eight_bit, share in ((False, 1.0 - eight_bit_fraction), (True, eight_bit_fraction)):
        if share <= 0:
            continue
        key = f"{path} threads={threads} {'8-bit' if eight_bit else 'fp32'} states cpu={cpu}"
        if key not in rates:
            rates[key] = time_update(eight_bit, threads)
        seconds += share / rates[key]
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rates, indent=1))
        os.replace(tmp, cache)  # atomic: a concurrent reader never sees half a file
    except OSError:
        pass  # a read-only home: measured again next time
    return 1.0 / seconds, path
