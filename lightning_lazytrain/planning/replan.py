"""When a run's MILP plan is solved again: for a batch larger than the plan's shape, and when the link drifts.

Batches padded to their longest sample change shape from step to step, and a plan's memory grows with the tokens:
a batch with more rows or columns than the plan was solved for would run past the device memory the plan counted
(after the first steps, the OOM ladder no longer catches it). Such a batch is planned for first, at its rows and
its length rounded up to ``SEQ_STEP`` (`grown_shape`; so a run meets a new plan a few times, not at every longer
batch); smaller batches keep the larger plan (`covers`).

Online re-plan (``LinkDrift``): every ``every`` steps the link is probed again; when a direction drifted from the
profile the plan was solved for by more than ``tolerance`` (another process on the PCIe link, a throttled GPU), the
MILP is solved again at that step boundary with the measured figures, and the change is logged.

``probe`` returns (h2d, d2h, both-at-once) bytes/s; on CUDA it is `engine.link.measure_link_cuda` (256 MiB pinned
copies, tens of milliseconds), elsewhere there is no link and no probe unless one is injected (the tests' slow
link). Per-layer compute times are not re-measured here: only the link.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from lightning_lazytrain.schedule import Profile

log = logging.getLogger(__name__)
GB = 1e9
SEQ_STEP = 128


def covers(planned: tuple[int, int], shape: tuple[int, int]) -> bool:
    """Whether a plan solved for ``planned`` (rows, length) serves a batch of ``shape``: its bytes only grow with
    the tokens, so any batch no larger."""
    return shape[0] <= planned[0] and shape[1] <= planned[1]


def grown_shape(planned: tuple[int, int], shape: tuple[int, int]) -> tuple[int, int]:
    """The shape to plan for when ``shape`` is not covered: the larger rows and columns, the columns rounded up."""
    seq = max(planned[1], shape[1])
    return max(planned[0], shape[0]), -(-seq // SEQ_STEP) * SEQ_STEP


def batch_shape(batch: Any) -> tuple[int, int]:
    ids = batch["input_ids"] if isinstance(batch, Mapping) else getattr(batch, "input_ids", None)
    if ids is None:
        raise ValueError("schedule='milp' plans for the batch shape: the batch must carry input_ids (B, T)")
    return ids.shape[0], ids.shape[-1]


@dataclasses.dataclass
class LinkDrift:
    every: int = 50
    tolerance: float = 0.25
    probe: Callable[[], tuple[float, float, float]] | None = None
    events: list[dict] = dataclasses.field(default_factory=list)

    def check(self, step: int, profile: Profile | None) -> Profile | None:
        """The profile to re-plan with at ``step``, or None when no probe is due or nothing drifted."""
        if self.probe is None or profile is None or self.every <= 0 or step == 0 or step % self.every:
            return None
        was = (profile.h2d_bytes_per_s, profile.d2h_bytes_per_s, profile.duplex_bytes_per_s)
        now = tuple(float(v) for v in self.probe())
        drift = max(abs(n / w - 1.0) for n, w in zip(now, was, strict=True))
        if drift <= self.tolerance:
            return None
        self.events.append({"step": step, "was_bytes_per_s": was, "now_bytes_per_s": now, "drift": drift})
        log.warning(
            "lazytrain: link bandwidth drifted %.0f%% from the plan's profile (h2d/d2h/both %s -> %s GB/s);"
            " re-planning at step %d",
            100 * drift,
            _gb(was),
            _gb(now),
            step,
        )
        sources = {**profile.sources, "h2d": "measured", "d2h": "measured", "duplex": "measured"}
        return dataclasses.replace(
            profile, h2d_bytes_per_s=now[0], d2h_bytes_per_s=now[1], duplex_bytes_per_s=now[2], sources=sources
        )


def _gb(values: tuple[float, ...]) -> str:
    return "/".join(f"{v / GB:.1f}" for v in values)
