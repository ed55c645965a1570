"""A run stopped at step k and resumed from its checkpoint ends bit-for-bit where the unbroken run ends."""

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from resume_setup import MAX_STEPS, assert_same_tree, fit, start_model

from lightning_lazytrain import AtomicCheckpointIO, LazyTrainStrategy
from lightning_lazytrain.engine import Schedule
from lightning_lazytrain.resume import STATE_KEY
from lightning_lazytrain.sft.data.sampler import ResumableDataLoader, ResumableRandomSampler


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
    assert all(p.grad is None for p in ref.parameters()), "the engine ran the updates itself (overlapped)"
    assert len(set(ref.draws)) == MAX_STEPS, "the training step draws from the global RNG every step"
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / (1 + MAX_STEPS))


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


def test_strategy_state_round_trips_through_a_checkpoint_file(tmp_path):
    """Skipped-step counters and the solved plan come back from disk (weights_only); the plan only for batches its
    shape covers."""
    saving = LazyTrainStrategy(schedule="milp")
    saving.resume.skipped_steps = 2
    saving.resume.nonfinite_guard.consecutive, saving.resume.nonfinite_guard.skipped = 1, 2
    saving.run_plan.schedule, saving.run_plan.shape = Schedule.every(4, 2), (2, 16)
    io, path = AtomicCheckpointIO(), tmp_path / "s.ckpt"
    io.save_checkpoint({STATE_KEY: saving.resume.dump()}, path)
    loading = LazyTrainStrategy(schedule="milp")
    loading.resume.load(io.load_checkpoint(path)[STATE_KEY])
    assert loading.resume.skipped_steps == 2
    assert loading.resume.nonfinite_guard.state_dict() == saving.resume.nonfinite_guard.state_dict()
    shape, plan = loading.run_plan.saved_plan((2, 16))
    assert shape == (2, 16) and plan.homes == saving.schedule_result.homes
    assert loading.run_plan.saved_plan((1, 9))[0] == (2, 16)  # a shorter batch runs the saved plan, for its shape
    assert loading.run_plan.saved_plan((4, 16)) is None and loading.run_plan.saved_plan((2, 17)) is None


def test_random_streams_are_restored_at_the_first_resumed_batch():
    saving = LazyTrainStrategy()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    state = saving.resume.dump()
    expected = (torch.rand(3), random.random(), np.random.rand())
    loading = LazyTrainStrategy()
    loading.resume.load(state)
    torch.manual_seed(2), random.seed(2), np.random.seed(2)  # what setup may consume in between
    loading.resume.before_batch()
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.random.rand() == expected[2]
