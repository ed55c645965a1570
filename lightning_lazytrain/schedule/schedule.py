"""The plan the streaming engine executes: a tier per boundary (+ optional per-window transfer assignment).

Indexing: layers ``0..L-1``, layer j reads boundary j and writes boundary j+1 (see `problem.py`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from lightning_lazytrain.engine.plan import HOMES, StackPlan

TIERS = HOMES  # the engine's names for where a boundary lives; one vocabulary for plans and the engine
_VERSION = 1


@dataclass(frozen=True)
class Transfer:
    """``bytes`` of boundary ``boundary`` moved in window ``window``.

    ``direction="offload"``: GPU->host during the *forward* of layer ``window`` (``window >= boundary``).
    ``direction="reload"``: host->GPU during the *backward* of layer ``window`` (``window >= e`` where (boundary, e)
    is the boundary's block), i.e. finished before the block's backward starts. ``tier`` is the boundary's home.
    ``window == num_layers`` means the head window (lm_head + loss, between forward and backward).
    """

    boundary: int
    window: int
    direction: str
    tier: str
    bytes: float


@dataclass
class Schedule:
    """Where each boundary's activation lives between its forward and its backward.

    tiers[i] for boundary i in 0..L:
      "gpu"       -- kept on the GPU from the forward until the backward that needs it.
      "cpu"       -- offloaded to pinned host memory in the forward, reloaded before its block's backward.
      "nvme"      -- offloaded through host memory to a spill file, read back before its block's backward.
      "recompute" -- dropped after the next layer consumed it; rebuilt in the backward by re-running the
                     forward from the previous materialized boundary.
    Boundaries 0 and L are always "gpu". ``keep_graph[j]`` (extension beyond the paper) means layer j keeps its whole
    autograd graph on the GPU, so its backward needs no re-forward; it requires (j, j+1) to be a block.
    """

    tiers: list[str]
    objective: float = 0.0
    predicted_exposed_seconds: float = 0.0
    status: str = "given"
    keep_graph: list[bool] | None = None
    transfers: list[Transfer] | None = None
    max_recompute_span: int | None = None
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tiers = list(self.tiers)
        n = len(self.tiers) - 1
        if n < 1:
            raise ValueError(f"Schedule.tiers needs L+1 >= 2 entries, got {len(self.tiers)}")
        if self.tiers[0] != "gpu" or self.tiers[-1] != "gpu":
            raise ValueError(f"Schedule boundaries 0 and L must be 'gpu', got {self.tiers[0]!r} / {self.tiers[-1]!r}")
        if self.keep_graph is None:
            self.keep_graph = [False] * n
        self.keep_graph = [bool(k) for k in self.keep_graph]
        blocks = self.stack_plan().blocks()  # the invariants every plan keeps (tiers known, graphs in blocks of one)
        if self.max_recompute_span is not None:
            too_long = [b for b in blocks if b[1] - b[0] > self.max_recompute_span]
            if too_long:
                raise ValueError(f"recompute block(s) {too_long} exceed max_recompute_span={self.max_recompute_span}")
        if self.transfers is not None:
            self.transfers = [t if isinstance(t, Transfer) else Transfer(**t) for t in self.transfers]

    def stack_plan(self) -> StackPlan:
        """What the engine runs of this plan: the boundary homes and the layers that keep their graph."""
        return StackPlan(tuple(self.tiers), tuple(self.keep_graph))

    @property
    def num_layers(self) -> int:
        return len(self.tiers) - 1

    def materialized(self) -> list[int]:
        """Boundaries whose activation is saved somewhere (gpu/cpu/nvme), ascending; always starts 0, ends L."""
        return [i for i, t in enumerate(self.tiers) if t != "recompute"]

    def blocks(self) -> list[tuple[int, int]]:
        """Recompute blocks (s, e) between consecutive materialized boundaries, ascending.

        Backward of block (s, e): load boundary s, re-run layers s..e-2 forward (no grad) to rebuild boundaries
        s+1..e-1, then run each layer e-1 down to s forward-with-grad + backward in reverse.
        """
        return self.stack_plan().blocks()

    def counts(self) -> dict[str, int]:
        """Boundaries per tier over all of 0..L."""
        return {t: self.tiers.count(t) for t in TIERS}

    def recomputed_layers(self) -> int:
        """Number of extra layer forwards the backward runs (sum over blocks of e - s - 1)."""
        return sum(e - s - 1 for s, e in self.blocks())

    def to_json(self, indent: int | None = 2) -> str:
        d = {
            "version": _VERSION,
            "tiers": self.tiers,
            "objective": self.objective,
            "predicted_exposed_seconds": self.predicted_exposed_seconds,
            "status": self.status,
            "keep_graph": self.keep_graph,
            "max_recompute_span": self.max_recompute_span,
            "transfers": None if self.transfers is None else [asdict(t) for t in self.transfers],
            "info": self.info,
        }
        return json.dumps(d, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        d = json.loads(text)
        if not isinstance(d, dict) or "tiers" not in d:
            raise ValueError("schedule JSON must be an object with a 'tiers' list")
        version = d.pop("version", _VERSION)
        if version != _VERSION:
            raise ValueError(f"schedule JSON version {version} is not supported (expected {_VERSION})")
        unknown = set(d) - {"tiers", "objective", "predicted_exposed_seconds", "status", "keep_graph",
                            "max_recompute_span", "transfers", "info"}
        if unknown:
            raise ValueError(f"schedule JSON has unknown keys {sorted(unknown)}")
        return cls(**d)


def interval_schedule(num_layers: int, k: int) -> Schedule:
    """The MegaTrain policy: boundaries 0, k, 2k, ..., and L on the GPU, everything else recomputed."""
    if num_layers < 1 or k < 1:
        raise ValueError(f"interval_schedule needs num_layers >= 1 and k >= 1, got {num_layers}, {k}")
    return Schedule(tiers=list(StackPlan.every(num_layers, k).homes), status=f"interval:{k}", max_recompute_span=k)


def all_gpu_schedule(num_layers: int) -> Schedule:
    """Every boundary saved on the GPU: no recompute, no activation traffic."""
    if num_layers < 1:
        raise ValueError(f"all_gpu_schedule needs num_layers >= 1, got {num_layers}")
    return Schedule(tiers=["gpu"] * (num_layers + 1), status="all_gpu", max_recompute_span=1)
