"""A run stopped at step k and resumed from its checkpoint ends bit-for-bit where the unbroken run ends."""

import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from resume_setup import MAX_STEPS, fit, start_model

from lightning_lazytrain.data.sampler import ResumableDataLoader, ResumableRandomSampler


class Crash(RuntimeError):
    pass


class CrashAt(pl.Callback):
    """Raise at the start of step ``step + 1``: checkpoints up to ``step`` are on disk, nothing after."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.step:
            raise Crash(f"simulated crash after step {self.step}")


def assert_same_tree(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        assert same, f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_run(resumed, resumed_trainer, ref, ref_trainer, k):
    assert resumed_trainer.global_step == ref_trainer.global_step == MAX_STEPS
    assert_same_tree(resumed.state_dict(), ref.state_dict(), "weights")
    assert_same_tree(resumed_trainer.optimizers[0].state_dict(), ref_trainer.optimizers[0].state_dict(), "optimizer")
    sched = [c.scheduler.state_dict() for c in resumed_trainer.lr_scheduler_configs]
    assert_same_tree(sched, [c.scheduler.state_dict() for c in ref_trainer.lr_scheduler_configs], "lr_scheduler")
    assert resumed.losses == ref.losses[k:]
    assert resumed.draws == ref.draws[k:]
    assert resumed.first_ids == ref.first_ids[k:]


@pytest.fixture(scope="module")
def unbroken():
    return fit(start_model(), None)


def test_unbroken_run_exercises_what_a_resume_must_carry(unbroken):
    ref, trainer = unbroken
    opt = trainer.optimizers[0]
    kinds = {opt.is_8bit(p) for p in ref.parameters()}
    assert kinds == {True, False}, "both 8-bit and fp32 moments must be in the run"
    assert len(set(ref.draws)) == MAX_STEPS, "the training step draws from the global RNG every step"
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / (1 + MAX_STEPS))


def test_resume_after_crash_mid_epoch_equals_unbroken(tmp_path, unbroken):
    k = 3  # mid-epoch (5 batches per epoch), and the resumed run crosses into epoch 1
    with pytest.raises(Crash):
        fit(start_model(), str(tmp_path), callbacks=(CrashAt(k),))
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == k
    resumed, trainer = fit(start_model(), str(tmp_path), ckpt_path="last", seed=999)
    assert_same_run(resumed, trainer, *unbroken, k)


def test_resume_after_sigkill_inside_a_save_equals_unbroken(tmp_path, unbroken):
    """A child process is killed -9 in the middle of writing last.ckpt for step 5 (after the temp file is
    complete, before the rename): last.ckpt still holds step 4, and resuming from it is exact."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.path.dirname(__file__)])}
    child = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "resume_setup.py"),
                            str(tmp_path), "5"], env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stderr[-2000:]
    assert any(n.endswith(".tmp") for n in os.listdir(tmp_path)), "the kill must leave the save unfinished"
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 4
    resumed, trainer = fit(start_model(), str(tmp_path), ckpt_path="last", seed=999)
    assert_same_run(resumed, trainer, *unbroken, 4)
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path)), "stale temp files are removed"


def test_sampler_continues_from_its_saved_position():
    data = list(range(7))
    loader = ResumableDataLoader(data, batch_size=2, sampler=ResumableRandomSampler(data, seed=4))
    loader.sampler.set_epoch(2)
    full = [int(x) for batch in loader for x in batch]
    it = iter(loader)
    seen = [int(x) for x in next(it)] + [int(x) for x in next(it)]
    state = loader.state_dict()
    assert state["position"] == 4 and state["epoch"] == 2
    fresh = ResumableDataLoader(data, batch_size=2, sampler=ResumableRandomSampler(data, seed=4))
    fresh.load_state_dict(state)
    fresh.sampler.set_epoch(2)  # what Lightning calls on resume: same epoch keeps the place
    rest = [int(x) for batch in fresh for x in batch]
    assert seen + rest == full and sorted(full) == data
    fresh.sampler.set_epoch(3)
    nxt = [int(x) for batch in fresh for x in batch]
    assert sorted(nxt) == data and nxt != full


def test_sampler_counts_what_workers_handed_out_not_what_they_prefetched():
    data = list(range(40))
    loader = ResumableDataLoader(data, batch_size=4, num_workers=1, prefetch_factor=4,
                                 sampler=ResumableRandomSampler(data, seed=1))
    it = iter(loader)
    next(it)
    next(it)
    assert loader.sampler.position > 8, "the worker drew indices ahead"
    assert loader.state_dict()["position"] == 8
    del it


def test_sampler_refuses_a_state_for_other_data():
    sampler = ResumableRandomSampler(list(range(5)))
    with pytest.raises(ValueError, match="for 6 samples but this dataset has 5"):
        sampler.load_state_dict({**sampler.state_dict(), "num_samples": 6})
