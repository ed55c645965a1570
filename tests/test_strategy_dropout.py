"""Dropout through re-run layers: each re-forward in the backward replays the generator state its forward began
with (as torch.utils.checkpoint(preserve_rng_state=True) does), so the gradients are those of the plain run."""

import pytest
import torch
from helpers import GradRecorder, batches, rel_diff, tiny_model, train

import lightning_lazytrain  # noqa: F401  (registers the strategy name)
from lightning_lazytrain import LazyTrainStrategy


def _seeded_train(model, data, seed=1234, **kw):
    torch.manual_seed(seed)
    recorder = GradRecorder()
    module, _ = train(model, data, callbacks=[recorder], **kw)
    return module, recorder


def _grad_rel_diff(a: GradRecorder, b: GradRecorder) -> float:
    num = sum(
        float((a.grads[s][k].double() - b.grads[s][k].double()).square().sum())
        for s in range(len(b.grads))
        for k in b.grads[s]
    )
    den = sum(float(g.double().square().sum()) for step in b.grads for g in step.values())
    return (num / den) ** 0.5


@pytest.mark.parametrize(
    ("family", "attn", "strategy"),
    [
        ("qwen2", "sdpa", LazyTrainStrategy()),
        ("qwen2", "eager", LazyTrainStrategy(schedule="interval:3", keep_graph_layers=1)),
        ("qwen3.5", "eager", LazyTrainStrategy(schedule="interval:2")),
    ],
    ids=["qwen2-sdpa-interval1", "qwen2-eager-interval3+graph1", "qwen3.5-eager-interval2"],
)
def test_attention_dropout_gradients_match_plain_run_with_same_seed(family, attn, strategy):
    model = tiny_model(family, attention_dropout=0.3)
    model.set_attn_implementation(attn)
    data = batches(3)
    ref, ref_grads = _seeded_train(model, data)
    lt, lt_grads = _seeded_train(model, data, strategy=strategy)
    _, other_seed = _seeded_train(model, data, seed=99)
    assert _grad_rel_diff(other_seed, ref_grads) > 1e-2, "the dropout masks must matter"
    assert _grad_rel_diff(lt_grads, ref_grads) <= 1e-5
    assert rel_diff(lt.model, ref.model, ref_grads.undecided()) <= 1e-5
    assert lt.losses == pytest.approx(ref.losses, rel=1e-6)
