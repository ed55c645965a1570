"""Lightning's EMA callback under the strategy: the same averages, validation metrics and final weights as a plain
run. The callback reads and writes the parameters in place (``.data.copy_``), which the engine cannot see."""

import copy
import functools
import time

import lightning.pytorch as pl
import pytest
from helpers import LMModule, batches, loader, rel_diff, tiny_model
from lightning.pytorch.callbacks import WeightAveraging
from test_engine_updates import HybridModule
from torch.optim.swa_utils import get_ema_avg_fn

from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.weight_averaging import WeightAveragingSync


class SlowHybridAdamW(HybridAdamW):
    """The engine's update lands 0.2 s after the step was queued: an average read before that sees the old
    weights."""

    def step_params(self, *args, **kwargs):
        time.sleep(0.2)
        return super().step_params(*args, **kwargs)


class SlowHybridModule(HybridModule):
    def configure_optimizers(self):
        return SlowHybridAdamW(self.parameters(), lr=self.lr, weight_decay=0.01, eight_bit_fraction=0.0)


class EvenStepEMA(WeightAveraging):
    """Averages after steps 0 and 2 of 4: the last step's update is still queued when training ends."""

    def __init__(self) -> None:
        super().__init__(avg_fn=get_ema_avg_fn(0.5))

    def should_update(self, step_idx=None, epoch_idx=None) -> bool:
        return step_idx is not None and step_idx % 2 == 0


class EpochEMA(WeightAveraging):
    """Averages at the end of each epoch only (as SWA does): the epoch's last update may still be queued then."""

    def __init__(self) -> None:
        super().__init__(avg_fn=get_ema_avg_fn(0.5))

    def should_update(self, step_idx=None, epoch_idx=None) -> bool:
        return epoch_idx is not None


# (the module the strategy trains, the module of its plain reference, the strategy's arguments): the delay of
# SlowHybridAdamW is there for the engine's queued updates only; a plain run of it updates as HybridModule does
CASES = {
    "torch-adamw": (LMModule, LMModule, dict),
    "engine-update-overlapped": (SlowHybridModule, HybridModule, dict),
    "device-share-resident": (
        HybridModule,
        HybridModule,
        lambda: dict(device_update_share=0.5, device_update_states="resident"),
    ),
}


def _fit(module, strategy, averaging=EvenStepEMA, validate=True):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision="32-true",
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        callbacks=[averaging()],
    )
    trainer.fit(
        module, train_dataloaders=loader(batches(2)), val_dataloaders=loader(batches(1, seed=7)) if validate else None
    )
    return trainer


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def plain(model):
    """The plain runs (Lightning's own strategy), each made once for the module's tests, which only read them:
    ``plain(module_cls, averaging, validate)``; ``averaging=None``: no averaging callback, the training weights."""

    @functools.cache
    def run(module_cls, averaging, validate=True):
        module = module_cls(copy.deepcopy(model))
        if averaging is None:
            pl.Trainer(
                accelerator="cpu",
                max_steps=4,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
            ).fit(module, loader(batches(2)))
        else:
            _fit(module, "auto", averaging, validate)
        return module

    return run


@pytest.mark.parametrize("averaging", [EvenStepEMA, EpochEMA])
@pytest.mark.parametrize("case", list(CASES))
def test_ema_validation_and_final_weights_match_plain(model, plain, case, averaging):
    """Validation (at the end of each 2-batch epoch) runs the average, training goes on from the training weights,
    and training ends with the average in the module, as in a plain run."""
    module_cls, ref_cls, strategy_args = CASES[case]
    ref = plain(ref_cls, averaging)
    plain_weights = plain(ref_cls, None)
    lt = module_cls(copy.deepcopy(model))
    trainer = _fit(lt, LazyTrainStrategy(**strategy_args()), averaging)
    assert isinstance(trainer.callbacks[0], WeightAveragingSync)
    assert rel_diff(ref.model, plain_weights.model) > 1e-3, "the average must differ from the training weights"
    assert lt.val_losses == pytest.approx(ref.val_losses, rel=1e-6)
    assert lt.losses == pytest.approx(ref.losses, rel=1e-6)
    assert rel_diff(lt.model, ref.model) <= 1e-5


@pytest.mark.parametrize("averaging", [EvenStepEMA, EpochEMA])
def test_the_updates_still_queued_land_before_the_average_reads_them(model, plain, averaging):
    """Without validation nothing else waits for the queued updates: the average read at an epoch's end, and the
    masters it is copied over when training ends, must still hold every step's update."""
    ref, lt = plain(HybridModule, averaging, validate=False), SlowHybridModule(copy.deepcopy(model))
    _fit(lt, LazyTrainStrategy(), averaging, validate=False)
    assert rel_diff(lt.model, ref.model) <= 1e-5


def test_no_sync_without_an_averaging_callback():
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=LazyTrainStrategy(),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(LMModule(tiny_model("qwen2")), loader(batches(1)))
    assert not any(isinstance(cb, WeightAveragingSync) for cb in trainer.callbacks)
