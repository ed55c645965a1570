"""A kept graph without its MLP's intermediates: the layer's ``mlp`` runs under a non-reentrant checkpoint.

Every supported family's decoder layer has an ``mlp`` submodule (the sparse MoE block in the MoE families). When a
plan marks a kept-graph layer ``mlp_recompute``, the stack runs that layer's forward inside ``checkpointed_mlp``:
for that one call ``layer.mlp.forward`` is an instance override that runs the real forward under
``torch.utils.checkpoint`` (``use_reentrant=False``), so autograd keeps only the MLP's input and re-runs the MLP
(gate/up/activation, the largest part of a layer's graph) when the layer's backward reaches it. The override is
removed as soon as the call returns: names, ``state_dict`` and the class's forward are never changed.

The parameters the MLP ran with are streamed device tensors bound only for the forward call (``binding.bound``);
the backward's re-run happens later, outside that binding, so it re-binds the very tensors the forward used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


def _rebinding(mlp: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` wrapped so that it runs with the parameters ``mlp`` holds right now, whenever it is called."""
    snapshot = [(mod, name, t) for mod in mlp.modules() for name, t in mod._parameters.items()]

    def run(*args: Any, **kwargs: Any) -> Any:
        before = [mod._parameters[name] for mod, name, _ in snapshot]
        for mod, name, t in snapshot:
            mod._parameters[name] = t
        try:
            return forward(*args, **kwargs)
        finally:
            for (mod, name, _), t in zip(snapshot, before, strict=True):
                mod._parameters[name] = t

    return run


@contextlib.contextmanager
def checkpointed_mlp(layer: nn.Module) -> Iterator[None]:
    """Within this context, calls of ``layer.mlp`` save only their inputs and re-run in the backward."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module):
        raise TypeError(
            f"mlp_recompute needs a decoder layer with an 'mlp' submodule; {type(layer).__name__} has none: "
            f"leave this layer out of the plan's mlp_recompute list"
        )
    own = mlp.__dict__.get("forward")  # an instance override someone else installed: run it, put it back
    inner = own if own is not None else type(mlp).forward.__get__(mlp)

    def forward(*args: Any, **kwargs: Any) -> Any:
        # bound here, at call time: the streamed tensors are in place only while the layer's forward runs
        return checkpoint(_rebinding(mlp, inner), *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    mlp.forward = forward
    try:
        yield
    finally:
        if own is None:
            del mlp.forward
        else:
            mlp.forward = own
