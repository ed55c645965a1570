"""The one plan type: the schedule package builds a ``Schedule`` (MILP, interval, JSON) and the executor runs it.

Boundary ``i`` is the input of layer ``i`` (boundary ``L`` is the stack's output). Between two consecutive kept
boundaries ``s < e`` lies one backward block: its layers are loaded once, layers ``s..e-2`` re-run without grad
to rebuild their inputs, then each layer runs with grad and back-propagates. A layer that keeps its graph runs
with grad in the forward and holds its weights and graph on the device until its backward (no re-forward); one
marked ``mlp_recompute`` keeps the graph of all but its MLP, which re-runs in its backward
(``compute/mlp_recompute.py``).

It lives in the engine, not in ``schedule/``, so that the executor runs plans without importing the solver.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

#: Where a boundary lives between its forward and its backward: kept on the GPU, offloaded to pinned host memory,
#: spilled through it to a file, or dropped and rebuilt by re-running the layers before it.
HOMES = ("gpu", "cpu", "nvme", "recompute")
#: version 2 names the per-boundary list ``homes``; version 1 (``tiers``) is still read
_VERSION = 2
_FIELDS = ("homes", "objective", "predicted_exposed_seconds", "status", "keep_graph", "max_recompute_span", "info",
           "mlp_recompute", "micro_batches")


@dataclass
class Schedule:
    """Where each boundary's activation lives between its forward and its backward, and which layers keep their
    graph.

    homes[i] for boundary i in 0..L, one of ``HOMES``:
      "gpu"       -- kept on the GPU from the forward until the backward that needs it.
      "cpu"       -- offloaded to pinned host memory in the forward, reloaded before its block's backward.
      "nvme"      -- offloaded through host memory to a spill file, read back before its block's backward.
      "recompute" -- dropped after the next layer consumed it; rebuilt in the backward by re-running the
                     forward from the previous materialized boundary.
    Boundaries 0 and L are always "gpu". ``keep_graph[j]`` (extension beyond the paper) means layer j keeps its whole
    autograd graph on the GPU, so its backward needs no re-forward; it requires (j, j+1) to be a block.
    ``mlp_recompute[j]`` (a kept-graph layer only) keeps that graph without the MLP's intermediates: only the MLP's
    input is saved and the MLP runs again in the layer's backward.
    ``micro_batches`` > 1 runs every layer on that many row slices of the batch, one after the other, and sums
    their weight gradients (`compute/micro_batches.py`): the same gradients, a per-layer working set that much smaller.
    ``objective``, ``predicted_exposed_seconds``, ``status`` and ``info`` are what the planner says of the plan; the
    engine reads only the homes, ``keep_graph``, ``mlp_recompute`` and ``micro_batches``.
    """

    homes: list[str]
    objective: float = 0.0
    predicted_exposed_seconds: float = 0.0
    status: str = "given"
    keep_graph: list[bool] | None = None
    max_recompute_span: int | None = None
    info: dict = field(default_factory=dict)
    mlp_recompute: list[bool] | None = None
    micro_batches: int = 1

    def __post_init__(self) -> None:
        self.homes = list(self.homes)
        n = len(self.homes) - 1
        if n < 1:
            raise ValueError(f"Schedule.homes needs L+1 >= 2 entries, got {len(self.homes)}")
        bad = [(i, h) for i, h in enumerate(self.homes) if h not in HOMES]
        if bad:
            raise ValueError(f"unknown home(s) {bad}; allowed: {HOMES}")
        if self.homes[0] != "gpu" or self.homes[-1] != "gpu":
            raise ValueError(f"Schedule boundaries 0 and L must be 'gpu', got {self.homes[0]!r} / {self.homes[-1]!r}")
        self.keep_graph = [False] * n if self.keep_graph is None else [bool(k) for k in self.keep_graph]
        if len(self.keep_graph) != n:
            raise ValueError(f"keep_graph must have one entry per layer ({n}), got {len(self.keep_graph)}")
        wrong = [j for j, keep in enumerate(self.keep_graph) if keep and not (self.kept(j) and self.kept(j + 1))]
        if wrong:
            raise ValueError(f"keep_graph layers {wrong} must be single-layer blocks (boundaries j and j+1 saved)")
        self.mlp_recompute = [False] * n if self.mlp_recompute is None else [bool(r) for r in self.mlp_recompute]
        if len(self.mlp_recompute) != n:
            raise ValueError(f"mlp_recompute must have one entry per layer ({n}), got {len(self.mlp_recompute)}")
        loose = [j for j, r in enumerate(self.mlp_recompute) if r and not self.keep_graph[j]]
        if loose:
            raise ValueError(f"mlp_recompute layers {loose} must also keep their graph (keep_graph); a layer that "
                             f"re-runs in the backward re-runs its MLP anyway")
        if int(self.micro_batches) != self.micro_batches or self.micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {self.micro_batches!r}")
        self.micro_batches = int(self.micro_batches)
        if self.max_recompute_span is not None:
            too_long = [b for b in self.blocks() if b[1] - b[0] > self.max_recompute_span]
            if too_long:
                raise ValueError(f"recompute block(s) {too_long} exceed max_recompute_span={self.max_recompute_span}")

    @classmethod
    def every(cls, num_layers: int, k: int = 1, keep_graph_layers: int = 0) -> Schedule:
        """The MegaTrain policy: boundaries 0, k, 2k, ..., and L on the GPU, the rest recomputed; and the whole
        graph of the last ``keep_graph_layers`` layers kept (their boundaries saved on the GPU).

        The last layers are the ones to keep: their backward comes first, so their graph is held the shortest time.
        """
        if num_layers < 1 or k < 1:
            raise ValueError(f"an interval plan needs num_layers >= 1 and k >= 1, got {num_layers}, {k}")
        homes = ["gpu" if i % k == 0 or i == num_layers else "recompute" for i in range(num_layers + 1)]
        keep = [j >= num_layers - keep_graph_layers for j in range(num_layers)]
        for j, flag in enumerate(keep):
            if flag:
                homes[j] = homes[j + 1] = "gpu"
        return cls(homes, status=f"interval:{k}", keep_graph=keep, max_recompute_span=k)

    @property
    def num_layers(self) -> int:
        return len(self.homes) - 1

    def kept(self, boundary: int) -> bool:
        return self.homes[boundary] != "recompute"

    def materialized(self) -> list[int]:
        """Boundaries whose activation is saved somewhere (gpu/cpu/nvme), ascending; always starts 0, ends L."""
        return [i for i, t in enumerate(self.homes) if t != "recompute"]

    def blocks(self) -> list[tuple[int, int]]:
        """Recompute blocks (s, e) between consecutive materialized boundaries, ascending.

        Backward of block (s, e): load boundary s, re-run layers s..e-2 forward (no grad) to rebuild boundaries
        s+1..e-1, then run each layer e-1 down to s forward-with-grad + backward in reverse.
        """
        kept = self.materialized()
        return list(zip(kept[:-1], kept[1:]))

    @property
    def predicted_stall_seconds(self) -> float:
        """Seconds the planner predicts the compute waits for the link a step (``info``'s transfers it could not
        hide and the step-start weight copy; 0 for a plan no solver priced). Re-forwards are compute, not stall."""
        return self.info.get("slack_seconds", 0.0) + self.info.get("step_start_seconds", 0.0)

    @property
    def max_block(self) -> int:
        return max((e - s for s, e in self.blocks()), default=1)

    @property
    def graph_layers(self) -> int:
        return sum(self.keep_graph)

    def counts(self) -> dict[str, int]:
        """Boundaries per home over all of 0..L."""
        return {t: self.homes.count(t) for t in HOMES}

    def recomputed_layers(self) -> int:
        """Number of extra layer forwards the backward runs (sum over blocks of e - s - 1)."""
        return sum(e - s - 1 for s, e in self.blocks())

    def slots_needed(self, prefetch: int = 1) -> int:
        """Device weight slots for this plan: held graphs, the largest block, and room to prefetch ahead."""
        return self.graph_layers + self.max_block + max(1, prefetch)

    def same_placement(self, other: Schedule) -> bool:
        """Whether both plans run the same way (what the planner says of them aside)."""
        return (self.homes == other.homes and self.keep_graph == other.keep_graph
                and self.mlp_recompute == other.mlp_recompute and self.micro_batches == other.micro_batches)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps({"version": _VERSION, **{name: getattr(self, name) for name in _FIELDS}}, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("schedule JSON must be an object with a 'homes' list")
        version = d.pop("version", _VERSION if "homes" in d else 1)
        if version not in (1, _VERSION):
            raise ValueError(f"schedule JSON version {version} is not supported (expected {_VERSION}, or 1)")
        if version == 1 and "tiers" in d:
            d["homes"] = d.pop("tiers")
        if "homes" not in d:
            raise ValueError("schedule JSON must be an object with a 'homes' list ('tiers' in version 1)")
        # Plans written before the solver stopped reporting its per-window transfers carry them: nothing runs them.
        d.pop("transfers", None)
        unknown = set(d) - set(_FIELDS)
        if unknown:
            raise ValueError(f"schedule JSON has unknown keys {sorted(unknown)}")
        return cls(**d)
