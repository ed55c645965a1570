"""What the executor needs from a schedule: which boundaries are kept, and which layers keep their graph.

Boundary ``i`` is the input of layer ``i`` (boundary ``L`` is the stack's output). Between two consecutive kept
boundaries ``s < e`` lies one backward block: its layers are loaded once, layers ``s..e-2`` re-run without grad
to rebuild their inputs, then each layer runs with grad and back-propagates. A layer that keeps its graph runs
with grad in the forward and holds its weights and graph on the device until its backward (no re-forward).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Where a boundary lives between its forward and its backward: kept on the GPU, offloaded to pinned host memory,
#: spilled through it to a file, or dropped and rebuilt by re-running the layers before it. The one vocabulary of
#: plans: ``schedule.Schedule.tiers`` uses these names too.
HOMES = ("gpu", "cpu", "nvme", "recompute")


@dataclass(frozen=True)
class StackPlan:
    """The invariants every plan keeps (``Schedule`` checks its own on top: ends on the GPU, the recompute span)."""

    homes: tuple[str, ...]
    keep_graph: tuple[bool, ...]

    def __post_init__(self) -> None:
        n = len(self.keep_graph)
        if len(self.homes) != n + 1:
            raise ValueError(f"keep_graph must have one entry per layer and the homes one more (boundaries 0..L): got"
                             f" {n} and {len(self.homes)}")
        bad = [(i, h) for i, h in enumerate(self.homes) if h not in HOMES]
        if bad:
            raise ValueError(f"unknown tier(s) {bad}; allowed: {HOMES}")
        if self.homes[0] == "recompute" or self.homes[-1] == "recompute":
            raise ValueError("boundaries 0 and L must be kept (the stack's input and output)")
        wrong = [j for j, keep in enumerate(self.keep_graph)
                 if keep and (self.homes[j] == "recompute" or self.homes[j + 1] == "recompute")]
        if wrong:
            raise ValueError(f"keep_graph layers {wrong} must be single-layer blocks (boundaries j and j+1 saved)")

    @property
    def num_layers(self) -> int:
        return len(self.keep_graph)

    def kept(self, boundary: int) -> bool:
        return self.homes[boundary] != "recompute"

    def blocks(self) -> list[tuple[int, int]]:
        kept = [i for i, h in enumerate(self.homes) if h != "recompute"]
        return list(zip(kept[:-1], kept[1:]))

    @property
    def max_block(self) -> int:
        return max((e - s for s, e in self.blocks()), default=1)

    @property
    def graph_layers(self) -> int:
        return sum(self.keep_graph)

    def counts(self) -> dict[str, int]:
        """Boundaries per home, for the homes the plan uses."""
        return {h: self.homes.count(h) for h in sorted(set(self.homes))}

    def slots_needed(self, prefetch: int = 1) -> int:
        """Device weight slots for this plan: held graphs, the largest block, and room to prefetch ahead."""
        return self.graph_layers + self.max_block + max(1, prefetch)

    @classmethod
    def every(cls, num_layers: int, k: int = 1, keep_graph_layers: int = 0) -> StackPlan:
        """Keep every ``k``-th boundary on the GPU (k=1: all), and the whole graph of the last N layers.

        The last layers are the ones to keep: their backward comes first, so their graph is held the shortest time.
        """
        if k < 1:
            raise ValueError(f"interval must be >= 1, got {k}")
        homes = ["gpu" if i % k == 0 or i == num_layers else "recompute" for i in range(num_layers + 1)]
        keep = [j >= num_layers - keep_graph_layers for j in range(num_layers)]
        for j, flag in enumerate(keep):
            if flag:
                homes[j] = homes[j + 1] = "gpu"
        return cls(tuple(homes), tuple(keep))
