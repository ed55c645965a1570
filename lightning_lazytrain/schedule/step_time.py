"""Predicted seconds of one training step for a plan, from its profile.

Forward of layer j: its compute ``rho_j`` or its weights' copy, whichever is longer (the copy of the next layer
runs beside it). Backward of layer j: its re-run (``rerun_seconds``, without the MLP's output projection) + the
backward (``Profile.backwards``: ``2 rho_j`` when every weight trains, about ``rho_j`` for a frozen LoRA base
layer, which computes no weight gradient), against the weights' second copy and the copy back of the trainable
weights' gradients (``Profile.gradients``; none for a frozen weight); a layer that
keeps its graph skips the re-run and the second copy (one that re-runs its MLP adds the MLP's forward). Then the
head, the plan's exposed seconds (re-forwards + transfers the links cannot hide, as the MILP charges them) and the
optimizer update.

The update is counted as exposed in full: the measured H200 steps waited for nearly all of it (1.14 of 1.27 s of
update work at 7B batch 64, 0.54 of 0.67 s at 3B batch 8; benchmarks/results/archive/h200.json), because it can start
only once the gradient norm is known, after the whole backward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lightning_lazytrain.engine.plan import Schedule

from .build import _ITEMSIZE
from .profile import Profile


@dataclass(frozen=True)
class StepPrediction:
    forward_s: float
    backward_s: float
    head_s: float
    exposed_s: float
    update_s: float

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.head_s + self.exposed_s + self.update_s

    def to_dict(self) -> dict:
        return {**asdict(self), "step_s": self.step_s}


def predict_step(
    profile: Profile,
    schedule: Schedule,
    update_s: float,
    grad_bytes_per_param: int | None = None,
) -> StepPrediction:
    """Seconds of one step of ``schedule`` on the machine ``profile`` describes; ``update_s`` is the optimizer's
    (of the trainable parameters only)."""
    h2d, d2h = profile.h2d_bytes_per_s, profile.d2h_bytes_per_s
    grad_scale = (grad_bytes_per_param or _ITEMSIZE.get(profile.dtype, 2)) / _ITEMSIZE.get(profile.dtype, 2)
    forward = backward = 0.0
    layers = zip(profile.forward_seconds, profile.backwards, profile.param_bytes, profile.gradients, strict=True)
    for j, (rho, beta, nbytes, grad_bytes) in enumerate(layers):
        copy = nbytes / h2d
        forward += max(rho, copy)
        kept = schedule.keep_graph[j]
        compute = beta + (0.0 if kept else profile.reruns[j])
        if schedule.mlp_recompute[j]:  # the MLP's re-run in the layer's backward
            compute += profile.mlp_seconds[j] if profile.mlp_seconds else rho
        backward += max(compute, 0.0 if kept else copy, grad_bytes * grad_scale / d2h)
    return StepPrediction(
        forward_s=forward,
        backward_s=backward,
        head_s=profile.head_seconds,
        exposed_s=schedule.predicted_exposed_seconds,
        update_s=update_s,
    )
