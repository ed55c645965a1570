"""gradient_clip_val on every family: lazytrain against plain Lightning, with torch's AdamW and with HybridAdamW."""

import pytest
from helpers import FAMILIES, GradRecorder, LMModule, batches, rel_diff, tiny_model, train

import lightning_lazytrain  # noqa: F401  (registers the strategy name)
from lightning_lazytrain.optim import HybridAdamW

CLIP = 0.5


class HybridAdamWModule(LMModule):
    def configure_optimizers(self):
        return HybridAdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def _runs(family, module_cls, recorders):
    model, data = tiny_model(family), batches(3)
    ref, _ = train(model, data, gradient_clip_val=CLIP, callbacks=[recorders[0]], module_cls=module_cls)
    lt, _ = train(
        model, data, strategy="lazytrain", gradient_clip_val=CLIP, callbacks=recorders[1:], module_cls=module_cls
    )
    return model, ref, lt


@pytest.mark.parametrize("family", FAMILIES)
def test_clipped_torch_adamw_matches_plain(family):
    """The norm the clip coefficient comes from (the host ``.grad`` of every parameter, experts included) equals
    the plain run's at every step, and so do the weights after three clipped steps."""
    ref_rec, lt_rec = GradRecorder(), GradRecorder()
    model, ref, lt = _runs(family, LMModule, [ref_rec, lt_rec])
    assert min(ref_rec.norms) > CLIP, "every step must be clipped"
    assert lt_rec.norms == pytest.approx(ref_rec.norms, rel=1e-5)
    skip = ref_rec.undecided()
    assert sum(int(m.sum()) for m in skip.values()) <= 0.01 * sum(p.numel() for p in model.parameters())
    assert rel_diff(lt.model, ref.model, skip) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_clipped_hybrid_adamw_matches_plain(family):
    """The engine's own update: the clip coefficient from the norms summed where the gradients land."""
    ref_rec = GradRecorder()
    model, ref, lt = _runs(family, HybridAdamWModule, [ref_rec])
    assert min(ref_rec.norms) > CLIP, "every step must be clipped"
    assert all(p.grad is None for p in lt.parameters()), "the engine ran the update"
    assert rel_diff(lt.model, ref.model, ref_rec.undecided()) <= 1e-5
