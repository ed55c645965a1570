"""Resident device states (``device_update_states="resident"``): the device share's masters and optimizer states
stay in the device path's own homes between steps. On the CPU accelerator those homes are separate tensors, so a
missing copy in or out shows as different numbers from the staged path (the same math, copied every update)."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from helpers import batches, loader, rel_diff, tiny_model
from test_engine_updates import HybridModule, fit

from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.engine.updates.traffic import UnitTraffic
from lightning_lazytrain.planning.update_placement import homes_that_fit


class CopiesIn(pl.Callback):
    """How often the device path copied masters and states in, and over how many units."""

    def on_train_end(self, trainer, module):
        trainer.strategy.executor.wait_updates()  # the last step's updates run behind the loop
        path = trainer.strategy.executor.updates.device_queue
        self.copies, self.units, self.resident = path.copies_in, len(path.units), path.resident


def states_of(module) -> list[torch.Tensor]:
    opt = module.trainer.optimizers[0]
    return [t for p in module.parameters() for t in opt.state_tensors(p)]


@pytest.mark.parametrize(("fraction", "precision"), [(1.0, "bf16-mixed"), (0.0, "32-true")])
def test_resident_states_give_the_staged_numbers(fraction, precision):
    model, data = tiny_model("qwen2"), batches(3)
    runs = {}
    for states in ("staged", "resident"):
        copies = CopiesIn()
        strategy = LazyTrainStrategy(device_update_share=0.5, device_update_states=states)
        module, _ = fit(HybridModule(copy.deepcopy(model), fraction, schedule=True), data, strategy,
                        precision=precision, gradient_clip_val=0.05, callbacks=[copies])
        runs[states] = module, copies
    (staged, staged_copies), (resident, resident_copies) = runs["staged"], runs["resident"]
    assert rel_diff(staged.model, model) > 1e-3
    assert rel_diff(resident.model, staged.model) == 0.0
    # the host states are current too (written back at teardown), equal to the staged path's
    assert all(torch.equal(a, b) for a, b in zip(states_of(resident), states_of(staged), strict=True))
    assert resident_copies.resident and not staged_copies.resident
    assert staged_copies.copies == 3 * staged_copies.units  # every update copies in
    assert resident_copies.copies == resident_copies.units  # once each: the homes kept them between steps


def test_resident_states_resume_exactly(tmp_path):
    """A checkpoint written mid-run holds the states the device homes reached (written back before the save), and
    a resume copies the loaded states in before its first update."""
    model, data = tiny_model("qwen2"), batches(2)

    def strategy():
        return LazyTrainStrategy(device_update_share=0.5, device_update_states="resident")

    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    straight, _ = fit(HybridModule(copy.deepcopy(model), 1.0), data, strategy(), max_steps=4, callbacks=[saver],
                      enable_checkpointing=True)
    resumed = HybridModule(copy.deepcopy(model), 1.0)
    trainer = pl.Trainer(accelerator="cpu", strategy=strategy(), max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(resumed, loader(data), ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    assert resumed.losses == straight.losses[2:]
    assert rel_diff(resumed.model, straight.model) == 0.0


class StateDictsAt(pl.Callback):
    """The module's and the optimizer's state dicts, cloned, right after batch ``at``'s step, read from a callback
    as a user's would."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == self.at:
            self.model = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
            self.optim = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])


@pytest.mark.parametrize(("share", "states"), [(0.0, "auto"), (0.5, "staged"), (0.5, "resident")])
def test_state_dicts_read_mid_run_hold_the_step_just_taken(share, states):
    """Updates run behind the loop, and resident masters and states stay on the device: a state dict read in a
    callback waits for them, so it equals what a run that stops after that step holds."""
    model, data = tiny_model("qwen2"), batches(3)

    def run(**kw):
        strategy = LazyTrainStrategy(device_update_share=share, device_update_states=states)
        return fit(HybridModule(copy.deepcopy(model), 1.0), data, strategy, precision="bf16-mixed",
                   gradient_clip_val=0.05, **kw)

    seen = StateDictsAt(1)
    run(callbacks=[seen])
    stopped, trainer = run(max_steps=2)
    final = stopped.model.state_dict()
    assert rel_diff(stopped.model, model) > 1e-3
    assert all(torch.equal(seen.model[k], v) for k, v in final.items())
    states_now = trainer.optimizers[0].state_dict()["state"]
    assert all(torch.equal(seen.optim[i][k], v) for i, st in states_now.items() for k, v in st.items()
               if isinstance(v, torch.Tensor))


def test_resident_homes_beyond_the_budget_go_back_to_the_cpu():
    traffic = [UnitTraffic(numel=10, h2d_bytes=0, d2h_bytes=20, grad_bytes=20, stream_bytes=20, home_bytes=100)
               for _ in range(5)]
    flags = [True, False, True, True, True]
    assert homes_that_fit(traffic, flags, 250) == [True, False, True, False, False]
    assert homes_that_fit(traffic, flags, 1000) == flags
    assert homes_that_fit(traffic, flags, 50) == [False] * 5


class RewindWeights(pl.Callback):
    """Keeps the module's weights after batch 0 and loads them back before batch 2, as a callback that rewinds a
    run would: the optimizer states carry on, the masters go back. ``through``: the strategy, the module's own
    ``load_state_dict``, or that load "by hand", with the engine's wait before and refresh after spelled out."""

    def __init__(self, through: str = "strategy") -> None:
        self.through = through

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 0:
            self.saved = {k: v.detach().clone() for k, v in module.state_dict().items()}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx != 2:
            return
        executor = trainer.strategy.executor
        if self.through == "strategy":
            trainer.strategy.load_model_state_dict({"state_dict": self.saved})
        elif self.through == "module":
            module.load_state_dict(self.saved)
        else:  # by hand: what the engine must do around a load, spelled out
            executor.wait_updates()
            module.load_state_dict(self.saved)
            executor.host_state_loaded(masters=True)


def test_weights_loaded_mid_run_reach_the_resident_homes():
    """A load rewrites the host masters in place; resident homes must copy them in again (a home kept from before
    the load goes on from the weights it replaced), so resident and staged runs with the same rewind agree."""
    model, data = tiny_model("qwen2"), batches(4)
    runs = {}
    for states in ("staged", "resident"):
        strategy = LazyTrainStrategy(device_update_share=0.5, device_update_states=states)
        runs[states], _ = fit(HybridModule(copy.deepcopy(model), 1.0), data, strategy, max_steps=4,
                              callbacks=[RewindWeights()])
    straight, _ = fit(HybridModule(copy.deepcopy(model), 1.0), data,
                      LazyTrainStrategy(device_update_share=0.5, device_update_states="staged"), max_steps=4)
    assert rel_diff(runs["staged"].model, straight.model) > 1e-4  # the rewind changed the run
    assert rel_diff(runs["resident"].model, runs["staged"].model) == 0.0


class LateEvent:
    """A stand-in for a CUDA event: complete once ``finish`` is called."""

    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished

    def finish(self) -> None:
        self.finished = True


def test_a_device_update_holds_its_unit_until_its_copy_out_completes():
    """The main thread queues a device unit's update and goes on; the unit's readers (the next forward's weight
    copy, a refresh) wait for the copy-out event, the wait is counted, and an event that never completes ends in
    an error naming the unit instead of a hang."""
    import threading

    from lightning_lazytrain.engine.updates.device import CopiedOut
    from lightning_lazytrain.engine.weights.layout import ParamUnit
    from lightning_lazytrain.engine.weights.versions import WeightVersions

    buffer = torch.zeros(4)
    unit = ParamUnit(0, "layer 0", [], 4, buffer, buffer)
    versions = WeightVersions([unit], stale=False)
    event = LateEvent()
    versions.hold(unit, CopiedOut(event, "the device update of layer 0", timeout_s=30.0))
    versions.written(unit)
    timer = threading.Timer(0.05, event.finish)
    timer.start()
    assert versions.refresh(unit) == 1
    assert event.finished, "the refresh returned before the copy out completed"
    assert versions.take_wait_seconds() >= 0.04
    timer.join()
    versions.hold(unit, CopiedOut(LateEvent(), "the device update of layer 0", timeout_s=0.05))
    with pytest.raises(TimeoutError, match="the device update of layer 0"):
        versions.refresh(unit)


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_a_callbacks_own_load_state_dict_reaches_what_streams(share):
    """bf16-mixed streams a bf16 copy of the masters (and a device share keeps its own): a callback loading weights
    with the module's own ``load_state_dict`` mid-run gets the run the strategy's load gives (the model's load
    hooks wait for queued updates, then refresh the streamed copies and device homes)."""
    model, data = tiny_model("qwen2"), batches(4)
    runs = {}
    for through in ("by hand", "module", "strategy"):
        strategy = LazyTrainStrategy(device_update_share=share, device_update_states="resident")
        runs[through], _ = fit(HybridModule(copy.deepcopy(model), 1.0), data, strategy, precision="bf16-mixed",
                               max_steps=4, callbacks=[RewindWeights(through)])
    assert rel_diff(runs["by hand"].model, model) > 1e-3
    assert rel_diff(runs["module"].model, runs["by hand"].model) == 0.0
    assert rel_diff(runs["strategy"].model, runs["by hand"].model) == 0.0


@pytest.mark.parametrize("states", ["resident", "staged"])
def test_a_plan_short_of_device_memory_names_what_the_device_share_holds(monkeypatch, states):
    """The GPU's share of the update takes device memory at setup (homes, or staging buffers) before the plan is
    solved: when the plan then does not fit, the error says how much and which setting gives it back."""
    from lightning_lazytrain.engine.updates.device import IN_FLIGHT, staging_bytes
    from lightning_lazytrain.planning import solve
    from lightning_lazytrain.schedule import InfeasibleScheduleError

    seen = []

    def tiny_total(executor):
        device = executor.path.updates.device_queue
        sizes = [staging_bytes(u, device.optimizer) for u in device.units]
        seen.append((executor.device_update_held_bytes, executor.device_update_reserve_bytes, sizes))
        return 1 << 16

    monkeypatch.setattr(solve, "device_plan_bytes", tiny_total)
    strategy = LazyTrainStrategy(schedule="milp", device_update_share=0.5, device_update_states=states)
    with pytest.raises(InfeasibleScheduleError, match="device_update_states='staged'") as err:
        fit(HybridModule(tiny_model("qwen2")), batches(1), strategy, max_steps=1)
    (held, reserve, sizes), *_ = seen
    assert held == (sum(sizes) if states == "resident" else IN_FLIGHT * max(sizes)) > 0
    assert f"{(held + reserve) / 2**30:.3f} GiB is held" in str(err.value)


def test_a_plan_short_of_device_memory_without_a_device_share_says_nothing_of_it(monkeypatch):
    from lightning_lazytrain.planning import solve
    from lightning_lazytrain.schedule import InfeasibleScheduleError

    monkeypatch.setattr(solve, "device_plan_bytes", lambda executor: 1 << 16)
    with pytest.raises(InfeasibleScheduleError) as err:
        fit(HybridModule(tiny_model("qwen2")), batches(1), LazyTrainStrategy(schedule="milp"), max_steps=1)
    assert "GPU memory short" in str(err.value) and "device_update" not in str(err.value)


@pytest.mark.parametrize("cpu_gib", [None, 1e-6])
def test_boundaries_short_of_the_default_cpu_budget_name_cpu_activation_gib(monkeypatch, cpu_gib):
    """Every boundary must be saved (span 1) and the GPU budget holds only the two ends: the refusal says where the
    CPU budget came from and which setting raises it, and says nothing of it when the user set it."""
    from types import SimpleNamespace

    from lightning_lazytrain.planning import solve
    from lightning_lazytrain.schedule import InfeasibleScheduleError

    available = 4 << 10
    # the planner's view only: admission reads the real host RAM
    monkeypatch.setattr(solve, "psutil", SimpleNamespace(virtual_memory=lambda: SimpleNamespace(available=available)))
    boundary = 2 * 16 * 64 * 4  # batches(1): 2 rows x 16 tokens x hidden 64, fp32 (32-true)
    strategy = LazyTrainStrategy(schedule="milp", max_recompute_span=1, gpu_activation_gib=2.5 * boundary / 2**30,
                                 cpu_activation_gib=cpu_gib)
    with pytest.raises(InfeasibleScheduleError, match="must be saved") as err:
        fit(HybridModule(tiny_model("qwen2")), batches(1), strategy, max_steps=1)
    assert err.value.saved_boundaries
    named = f"is a quarter of the {available / 2**30:.1f} GiB of host RAM available at this batch: cpu_activation_gib"
    assert (named in str(err.value)) == (cpu_gib is None)
