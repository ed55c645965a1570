"""A parameter that no backward gave a gradient keeps ``.grad`` None on the host path, as in a plain run.

torch's AdamW (and HybridAdamW's ``step``) skip a parameter whose ``.grad`` is None: no weight decay, no state, no
step count. A zero ``.grad`` instead decays the weight and advances its moments. The setting is issue 37's: a
3-layer Qwen3-MoE, AdamW(lr=3e-3, weight_decay=0.01), gradient_clip_val=0.5, sequences of 24, with the embedding
and one layer's q_norm frozen while the optimizer still holds every parameter (``self.parameters()``).
"""

import pytest
import torch
from helpers import GradRecorder, LMModule, batches, rel_diff, tiny_model, train

import lightning_lazytrain  # noqa: F401  (registers the strategy name)
from lightning_lazytrain.optim import HybridAdamW

FROZEN = ["model.embed_tokens.weight", "model.layers.1.self_attn.q_norm.weight"]


class HybridAdamWModule(LMModule):
    def configure_optimizers(self):
        return HybridAdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def _frozen_model():
    model = tiny_model("qwen3-moe", num_hidden_layers=3)
    params = dict(model.named_parameters())
    for name in FROZEN:
        params[name].requires_grad_(False)
    return model


@pytest.mark.parametrize("accumulate", [1, 2])
def test_frozen_parameters_in_torch_adamw_are_left_alone(accumulate):
    """Before the fix every parameter of a unit that got any gradient had a zero ``.grad``: the frozen embedding
    moved by lr * weight_decay * w each step and AdamW kept a state for it."""
    model, data, recorder = _frozen_model(), batches(3 * accumulate, seq=24), GradRecorder()
    kw = dict(gradient_clip_val=0.5, accumulate_grad_batches=accumulate, lr=3e-3)
    ref, _ = train(model, data, callbacks=[recorder], **kw)
    lt, _ = train(model, data, strategy="lazytrain", **kw)
    start, after = model.state_dict(), lt.model.state_dict()
    for name in FROZEN:
        assert torch.equal(after[name], start[name]), name
    params = dict(lt.model.named_parameters())
    opt = lt.trainer.optimizers[0]
    assert all(params[name].grad is None and params[name] not in opt.state for name in FROZEN)
    assert len(opt.state) == len(ref.trainer.optimizers[0].state)
    assert min(recorder.norms) > 0.5, "every step must be clipped"
    assert rel_diff(ref.model, model) > 1e-3, "the reference run must have moved the weights"
    assert rel_diff(lt.model, ref.model, recorder.undecided()) <= 2e-6


def test_frozen_parameters_in_hybrid_adamw_are_left_alone():
    """The engine's own update skips them too (its units' ``requires_grad``), against plain HybridAdamW."""
    model, data, recorder = _frozen_model(), batches(3, seq=24), GradRecorder()
    kw = dict(gradient_clip_val=0.5, module_cls=HybridAdamWModule, lr=3e-3)
    ref, _ = train(model, data, callbacks=[recorder], **kw)
    lt, _ = train(model, data, strategy="lazytrain", **kw)
    start, after = model.state_dict(), lt.model.state_dict()
    assert all(torch.equal(after[name], start[name]) for name in FROZEN)
    assert rel_diff(lt.model, ref.model, recorder.undecided()) <= 2e-6
