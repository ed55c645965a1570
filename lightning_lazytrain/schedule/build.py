"""Turn a `Profile` into the solver's `ScheduleProblem` (window model of docs/schedule.md).

Window w is layer w's compute, forward and backward together. What the engine runs in it, for every schedule:

* the forward of layer w (``rho_w``, no grad),
* in the backward, layer w's forward-with-grad from its boundary, ``rho'_w`` (every block re-runs its layers with
  grad, skipping the MLP's output projection: ``rerun_seconds``; only the *extra* no-grad re-forwards of a block,
  ``R(s, e)``, are schedule-dependent and the solver charges them),
* layer w's backward, ``beta_w`` (``Profile.backwards``: input gradients through every weight, weight gradients
  of the trainable ones only; ``2 rho_w`` when all train, about ``rho_w`` for a frozen LoRA base layer).

So ``window_seconds[w] = rho_w + beta_w + rho'_w`` with ``reforward=True`` (the default, what the engine does
without ``keep_graph``), or ``rho_w + beta_w`` with ``reforward=False`` (every layer keeps its graph).
The recompute forwards of ``R(s, e)`` are left out of the windows: the capacity is a lower estimate.

Mandatory traffic per window: ``param_h2d_bytes[w] = 2 * param_bytes[w]`` (the layer's streamed weights copied for
the forward and again for the backward; a recompute block's no-grad re-forward reuses the backward copy, as
``engine/compute/stack.py`` does; ``reforward=False`` means the layer keeps weights and graph from the forward: one
copy),
``grad_d2h_bytes[w] = Profile.gradients[w]`` (the trainable weights' gradients go back in the stream dtype, bf16
under bf16-mixed; a frozen weight sends none), scaled to ``grad_bytes_per_param`` when that is given.

GPU memory: the profile's per-layer graph and working-set bytes, and the graph bytes and MLP seconds of a kept graph
whose MLP re-runs, go to the problem (``keep_graphs=False`` offers no kept graphs of either kind);
``gpu_total_bytes``, ``slot_bytes``, ``fixed_slots`` and ``head_working_bytes`` are the device's side,
which the caller knows (`plan_problem.py` sets them for the run and the forecast).

Link: forward offloads run beside weight prefetches and backward reloads beside gradient copies, so both
directions are busy together. With ``duplex=True`` (default) each direction gets
``min(one-way, both-at-once / 2)``; with ``duplex=False`` the one-way figures.
"""

from __future__ import annotations

from .problem import ScheduleProblem
from .profile import Profile

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def build_problem(profile: Profile, gpu_budget_bytes: int, cpu_budget_bytes: int, nvme_budget_bytes: int,
                  max_recompute_span: int = 4, *, reforward: bool = True,
                  duplex: bool = True, grad_bytes_per_param: int | None = None, keep_graphs: bool = True,
                  keep_graph_layers: list[int] | None = None, gpu_total_bytes: int | None = None,
                  slot_bytes: int = 0, fixed_slots: int = 0, head_working_bytes: int = 0,
                  micro_batches: int = 1) -> ScheduleProblem:
    """The placement problem for ``profile`` under the given activation budgets (bytes per home).

    ``window_seconds[w] = forward_seconds[w] + backwards[w] + reforward * rerun_seconds[w]`` (the re-run
    without the MLP's output projection; ``forward_seconds`` where not profiled); ``param_h2d_bytes[w] =
    (1 + reforward) * param_bytes[w]``; ``grad_d2h_bytes[w] = gradients[w]`` (or
    ``* grad_bytes_per_param / itemsize``); ``head_seconds`` as profiled; bandwidths: see the module docstring.
    ``micro_batches``: the layer micro-batches ``profile.working_bytes`` was counted for (`plan_problem`).
    """
    itemsize = _ITEMSIZE.get(profile.dtype, 2)
    h2d, d2h = profile.h2d_bytes_per_s, profile.d2h_bytes_per_s
    if duplex:
        h2d, d2h = min(h2d, profile.duplex_bytes_per_s / 2), min(d2h, profile.duplex_bytes_per_s / 2)
    return ScheduleProblem(
        activation_bytes=list(profile.activation_bytes),
        forward_seconds=list(profile.forward_seconds),
        window_seconds=[f + b + (r if reforward else 0.0)
                        for f, b, r in zip(profile.forward_seconds, profile.backwards, profile.reruns, strict=True)],
        rerun_seconds=list(profile.reruns),
        param_h2d_bytes=[(2 if reforward else 1) * b for b in profile.param_bytes],
        grad_d2h_bytes=[b * (grad_bytes_per_param or itemsize) // itemsize for b in profile.gradients],
        gpu_budget_bytes=int(gpu_budget_bytes),
        cpu_budget_bytes=int(cpu_budget_bytes),
        nvme_budget_bytes=int(nvme_budget_bytes),
        h2d_bytes_per_s=float(h2d),
        d2h_bytes_per_s=float(d2h),
        nvme_read_bytes_per_s=float(profile.nvme_read_bytes_per_s),
        nvme_write_bytes_per_s=float(profile.nvme_write_bytes_per_s),
        max_recompute_span=int(max_recompute_span),
        head_seconds=float(profile.head_seconds),
        graph_bytes=list(profile.graph_bytes) if keep_graphs and profile.graph_bytes else None,
        working_bytes=list(profile.working_bytes) or None,
        mlp_graph_bytes=list(profile.mlp_graph_bytes) if keep_graphs and profile.mlp_graph_bytes else None,
        mlp_seconds=list(profile.mlp_seconds) if keep_graphs and profile.mlp_graph_bytes else None,
        head_working_bytes=int(head_working_bytes),
        slot_bytes=int(slot_bytes),
        fixed_slots=int(fixed_slots),
        gpu_total_bytes=gpu_total_bytes,
        keep_graph_layers=list(keep_graph_layers or []),
        micro_batches=int(micro_batches),
    )
