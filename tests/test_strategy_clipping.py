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


@pytest.mark.parametrize("module_cls", [LMModule, HybridAdamWModule], ids=["torch-adamw", "hybrid-adamw"])
def test_issue_37_moe_setting_matches_plain(module_cls):
    """Issue 37's setting: 3 layers, lr 3e-3, sequences of 24, three clipped steps. The 1.3e-4 drift reported
    there is one embedding element whose gradient is rounding-level (1.2e-7 in one run, 2.0e-8 in the other, row
    max 3.3e-2, measured with model seed 9 and no masked labels): clipped by 0.5 / 2.5 it sits near AdamW's
    eps = 1e-8, where
    the step follows the gradient's value instead of its sign, so rounding moves the weight by up to lr. Without
    such elements (``undecided``) the runs agree to 6e-7."""
    model, data, recorder = tiny_model("qwen3-moe", num_hidden_layers=3), batches(3, seq=24), GradRecorder()
    kw = dict(gradient_clip_val=CLIP, module_cls=module_cls, lr=3e-3)
    ref, _ = train(model, data, callbacks=[recorder], **kw)
    lt, _ = train(model, data, strategy="lazytrain", **kw)
    assert min(recorder.norms) > CLIP, "every step must be clipped"
    skip = recorder.undecided()
    assert sum(int(m.sum()) for m in skip.values()) <= 0.01 * sum(p.numel() for p in model.parameters())
    assert rel_diff(lt.model, ref.model, skip) <= 2e-6
