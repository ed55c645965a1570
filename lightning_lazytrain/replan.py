"""Online re-plan: every ``every`` steps the link is probed again; when a direction drifted from the profile the
plan was solved for by more than ``tolerance`` (another process on the PCIe link, a throttled GPU), the MILP is
solved again at that step boundary with the measured figures, and the change is logged.

``probe`` returns (h2d, d2h, both-at-once) bytes/s; on CUDA it is `engine.link.measure_link_cuda` (256 MiB pinned
copies, tens of milliseconds), elsewhere there is no link and no probe unless one is injected (the tests' slow
link). Per-layer compute times are not re-measured here: only the link.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from lightning_lazytrain.schedule import Profile

log = logging.getLogger(__name__)
GB = 1e9


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
