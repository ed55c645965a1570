"""Probe the host-device link: pinned copy bandwidth each way and both ways at once, timed with CUDA events."""

from __future__ import annotations

import torch

LINK_PROBE_BYTES = 256 << 20


def measure_link_cuda(device: torch.device, nbytes: int = LINK_PROBE_BYTES, reps: int = 3) -> tuple[float, ...]:
    """Pinned H2D, D2H and both at once on two streams; best of ``reps``; bytes/s (duplex = total of both)."""
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def timed(copies) -> float:
        best = float("inf")
        for r in range(reps + 1):
            start = torch.cuda.Event(enable_timing=True)
            start.record(s1)
            s2.wait_event(start)
            ends = []
            for stream, dst, src in copies:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                ends.append(torch.cuda.Event(enable_timing=True))
                ends[-1].record(stream)
            for e in ends:
                e.synchronize()
            if r:  # the first round is a warm-up
                best = min(best, max(start.elapsed_time(e) for e in ends) / 1e3)
        return best

    h2d = nbytes / timed([(s1, dev_a, host_a)])
    d2h = nbytes / timed([(s1, host_a, dev_a)])
    duplex = 2 * nbytes / timed([(s1, dev_a, host_a), (s2, host_b, dev_b)])
    del dev_a, dev_b
    torch.cuda.empty_cache()
    return h2d, d2h, duplex
