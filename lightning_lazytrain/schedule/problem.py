"""The inputs of the activation-placement plan: one `ScheduleProblem` per (model shape, batch, machine).

Indexing used everywhere in `schedule/`: layers ``j = 0..L-1`` (0-based); layer ``j`` reads boundary ``j`` and
writes boundary ``j + 1``, so boundaries are ``0..L`` (0 = input of the first decoder layer, L = output of the
last). Window ``w`` is layer ``w``'s compute (its forward and its backward together, as in the paper's model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from lightning_lazytrain.units import GIB as GIB


def _check_list(name: str, values: list, length: int, *, integral: bool) -> None:
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"ScheduleProblem.{name} must be a list, got {type(values).__name__}")
    if len(values) != length:
        raise ValueError(f"ScheduleProblem.{name} must have {length} entries, got {len(values)}")
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"ScheduleProblem.{name}[{k}] must be a number, got {v!r}")
        if integral and not float(v).is_integer():
            raise ValueError(f"ScheduleProblem.{name}[{k}] must be a whole number of bytes, got {v!r}")
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"ScheduleProblem.{name}[{k}] must be finite and >= 0, got {v!r}")


def _check_scalar(name: str, v: float, *, positive: bool) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"ScheduleProblem.{name} must be a number, got {v!r}")
    if math.isnan(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"ScheduleProblem.{name} must be {'> 0' if positive else '>= 0'}, got {v!r}")


@dataclass
class ScheduleProblem:
    """Everything the MILP needs, in bytes, seconds and bytes per second.

    Args:
        activation_bytes: ``A_i`` for boundaries ``0..L`` (L+1 entries): bytes of the hidden state at boundary i.
        forward_seconds: ``rho_j`` for layers ``0..L-1``: time of one forward of layer j (what re-building a
            dropped boundary costs).
        rerun_seconds: per layer, its forward-with-grad re-run in its own backward, which skips the MLP's output
            projection (`engine/compute/gradient_only_linear.py`): what keeping its graph saves. ``None``:
            ``forward_seconds``.
        window_seconds: compute time of window w (layer w's forward, re-run and backward), the time transfers can
            hide in.
        param_h2d_bytes: mandatory parameter bytes copied host->GPU during window w (both passes together).
        grad_d2h_bytes: mandatory gradient bytes copied GPU->host during window w.
        gpu_budget_bytes / cpu_budget_bytes / nvme_budget_bytes: bytes available for saved boundaries per home
            (GPU counts boundaries 0 and L, which always stay there).
        h2d_bytes_per_s / d2h_bytes_per_s: PCIe bandwidth per direction.
        nvme_read_bytes_per_s / nvme_write_bytes_per_s: spill-disk bandwidth.
        max_recompute_span: longest recompute block (e - s) allowed; 1 means every boundary is materialized.
        head_seconds: compute between the last forward and the first backward (lm_head + loss); reloads of
            boundaries whose block ends at L can only hide there. Default 0: such reloads are fully exposed.
        lambda_materialize / lambda_cpu / lambda_nvme: tie-breakers (seconds per boundary) that prefer fewer
            materialized boundaries, then GPU over CPU over NVMe, when the main objective is tied.
        graph_bytes: per layer, the GPU bytes its autograd graph holds beyond its input boundary when it keeps its
            graph from the forward (saves its re-forward in the backward). ``None``: keeping graphs is not offered
            (except for ``keep_graph_layers``, counted at 0 bytes).
        mlp_graph_bytes: per layer, the GPU bytes its kept graph holds when its MLP re-runs in the backward instead
            (the attention half's graph and the MLP's input). ``None``: that choice is not offered.
        mlp_seconds: per layer, one forward of its MLP (what that choice re-runs in the backward); given together
            with ``mlp_graph_bytes``.
        working_bytes: per layer, the peak transient GPU bytes of its forward-with-grad and backward beyond its
            input boundary (MLP intermediates, attention, weight and input gradients). ``None``: not modelled.
        head_working_bytes: the same for the head window (lm_head chunk + loss, forward and backward).
        slot_bytes / fixed_slots: one device weight slot, and the slots every plan holds for prefetching; a block
            (s, e) holds e - s slots at once and a kept graph holds one until its backward.
        gpu_total_bytes: the device memory the whole plan may use (saved boundaries, kept graphs, slots, the largest
            block's rebuilt boundaries and working set); ``None``: only ``gpu_budget_bytes`` is checked.
        keep_graph_layers: layers that must keep their graph (the user's ``keep_graph_layers``).
        micro_batches: the row slices each layer runs in, which ``working_bytes`` counts (`plan_problem`); the
            solved plan runs them (``Schedule.micro_batches``).
    """

    activation_bytes: list[int]
    forward_seconds: list[float]
    window_seconds: list[float]
    param_h2d_bytes: list[int]
    grad_d2h_bytes: list[int]
    gpu_budget_bytes: int
    cpu_budget_bytes: int
    nvme_budget_bytes: int
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float
    max_recompute_span: int
    head_seconds: float = 0.0
    lambda_materialize: float = 1e-7
    lambda_cpu: float = 1e-8
    lambda_nvme: float = 1e-7
    graph_bytes: list[int] | None = None
    working_bytes: list[int] | None = None
    mlp_graph_bytes: list[int] | None = None
    mlp_seconds: list[float] | None = None
    head_working_bytes: int = 0
    slot_bytes: int = 0
    fixed_slots: int = 0
    gpu_total_bytes: int | None = None
    keep_graph_layers: list[int] = field(default_factory=list)
    rerun_seconds: list[float] | None = None
    micro_batches: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.activation_bytes, (list, tuple)) or len(self.activation_bytes) < 2:
            raise ValueError("ScheduleProblem.activation_bytes needs L+1 >= 2 entries (boundaries 0..L)")
        n = len(self.activation_bytes) - 1
        _check_list("activation_bytes", self.activation_bytes, n + 1, integral=True)
        _check_list("forward_seconds", self.forward_seconds, n, integral=False)
        _check_list("window_seconds", self.window_seconds, n, integral=False)
        _check_list("param_h2d_bytes", self.param_h2d_bytes, n, integral=True)
        _check_list("grad_d2h_bytes", self.grad_d2h_bytes, n, integral=True)
        for name in ("gpu_budget_bytes", "cpu_budget_bytes", "nvme_budget_bytes", "head_seconds",
                     "lambda_materialize", "lambda_cpu", "lambda_nvme"):
            _check_scalar(name, getattr(self, name), positive=False)
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "nvme_read_bytes_per_s", "nvme_write_bytes_per_s"):
            _check_scalar(name, getattr(self, name), positive=True)
        span = self.max_recompute_span
        if isinstance(span, bool) or not isinstance(span, int) or span < 1:
            raise ValueError(f"ScheduleProblem.max_recompute_span must be an int >= 1, got {span!r}")
        for name in ("graph_bytes", "working_bytes", "mlp_graph_bytes"):
            if getattr(self, name) is not None:
                _check_list(name, getattr(self, name), n, integral=True)
                setattr(self, name, [int(v) for v in getattr(self, name)])
        if (self.mlp_graph_bytes is None) != (self.mlp_seconds is None):
            raise ValueError("ScheduleProblem.mlp_graph_bytes and mlp_seconds go together: give both or neither")
        if self.mlp_seconds is not None:
            _check_list("mlp_seconds", self.mlp_seconds, n, integral=False)
            self.mlp_seconds = [float(v) for v in self.mlp_seconds]
        for name in ("head_working_bytes", "slot_bytes", "fixed_slots"):
            _check_scalar(name, getattr(self, name), positive=False)
        _check_scalar("micro_batches", self.micro_batches, positive=True)
        if self.gpu_total_bytes is not None:
            _check_scalar("gpu_total_bytes", self.gpu_total_bytes, positive=False)
        bad = [j for j in self.keep_graph_layers if not (isinstance(j, int) and 0 <= j < n)]
        if bad:
            raise ValueError(f"ScheduleProblem.keep_graph_layers has layers outside 0..{n - 1}: {bad}")
        self.keep_graph_layers = sorted(set(self.keep_graph_layers))
        # Normalise to plain Python lists of the right type so JSON and the solver see one representation.
        self.activation_bytes = [int(v) for v in self.activation_bytes]
        self.param_h2d_bytes = [int(v) for v in self.param_h2d_bytes]
        self.grad_d2h_bytes = [int(v) for v in self.grad_d2h_bytes]
        self.forward_seconds = [float(v) for v in self.forward_seconds]
        self.window_seconds = [float(v) for v in self.window_seconds]
        if self.rerun_seconds is not None:
            _check_list("rerun_seconds", self.rerun_seconds, n, integral=False)
            self.rerun_seconds = [float(v) for v in self.rerun_seconds]

    @property
    def num_layers(self) -> int:
        return len(self.activation_bytes) - 1

    @property
    def step_start_seconds(self) -> float:
        """The first layer's weight copy at each step's start: it can begin only once that layer's update landed,
        and the GPU has nothing but the embedding to run beside it, so it is exposed whatever the plan (one
        ``slot_bytes`` over the H2D link; 0 where the slot size is not given)."""
        return self.slot_bytes / self.h2d_bytes_per_s

    @property
    def reruns(self) -> list[float]:
        """``rho'_j``: each layer's re-run in its backward (``rerun_seconds``, else ``forward_seconds``)."""
        return self.rerun_seconds if self.rerun_seconds is not None else self.forward_seconds

    def recompute_seconds(self, s: int, e: int) -> float:
        """R(s, e): re-forward time of block (s, e); its last layer runs with grad anyway, so it is free."""
        return float(sum(self.forward_seconds[s : e - 1]))

    def block_peak_bytes(self, s: int, e: int) -> int:
        """GPU bytes block (s, e)'s backward adds at its peak: its weight slots, its rebuilt boundaries s+1..e-1,
        the largest working set among its layers, the gradients of the layer above still on their way to the host
        (one slot's bytes) and ``reload_bytes``."""
        work = max(self.working_bytes[s:e]) if self.working_bytes is not None else 0
        return (e - s + 1) * self.slot_bytes + sum(self.activation_bytes[s + 1 : e]) + work + self.reload_bytes

    @property
    def head_peak_bytes(self) -> int:
        """GPU bytes the head window adds at its peak: its working set and, where boundaries may live off the
        GPU, the backward's first input, which the forward's end starts bringing back while the head runs."""
        return self.head_working_bytes + self._returning_boundary_bytes

    @property
    def reload_bytes(self) -> int:
        """Where boundaries may live off the GPU: a running block's input and the next block's, brought back from
        the CPU or NVMe (the engine allocates the next one when it starts the copy, early). Charged to every block
        as two of the largest inner boundary, whatever their homes: bounded, and the same for every block, so the
        batch search's test without a solve stays exact."""
        return 2 * self._returning_boundary_bytes

    @property
    def _returning_boundary_bytes(self) -> int:
        """One boundary on its way back to the GPU: the largest inner one, or 0 where none may leave the GPU."""
        if self.cpu_budget_bytes + self.nvme_budget_bytes == 0:
            return 0
        return max(self.activation_bytes[1:-1], default=0)

    def may_keep_graph(self, j: int) -> bool:
        return self.graph_bytes is not None or j in self.keep_graph_layers

    def may_recompute_mlp(self, j: int) -> bool:
        """Whether layer j may keep its graph with the MLP re-run in the backward."""
        return self.mlp_graph_bytes is not None and j not in self.keep_graph_layers

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
