"""The engine running HybridAdamW itself, per layer, from bf16 host gradients: same numbers as a plain run."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from helpers import LMModule, batches, loader, rel_diff, tiny_model, update_rel_diff

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.optim import HybridAdamW


class HybridModule(LMModule):
    def __init__(self, model, fraction=0.0, schedule=False, nan_steps=(), **kw):
        super().__init__(model, **kw)
        self.fraction, self.schedule, self.nan_steps = fraction, schedule, set(nan_steps)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step in self.nan_steps else loss

    def configure_optimizers(self):
        opt = HybridAdamW(self.parameters(), lr=self.lr, weight_decay=0.01, eight_bit_fraction=self.fraction,
                          min_8bit_numel=1024)
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class BusySeconds(pl.Callback):
    """The CPU worker's busy seconds and the main thread's seconds queuing device updates, summed over every
    step's stats."""

    def __init__(self) -> None:
        self.cpu = self.device = 0.0

    def on_train_batch_end(self, trainer, *args) -> None:
        self.cpu += trainer.strategy.last_step_stats.get("update_busy_s", 0.0)
        self.device += trainer.strategy.last_step_stats.get("device_update_launch_s", 0.0)


def fit(module, data, strategy="auto", precision="32-true", max_steps=3, accelerator="cpu", **kw):
    trainer = pl.Trainer(accelerator=accelerator, strategy=strategy, precision=precision, max_steps=max_steps,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         **{"enable_checkpointing": False, **kw})
    trainer.fit(module, loader(data))
    return module, trainer


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_direct_updates_match_plain_hybrid_adamw_with_clipping_and_scheduler(fraction):
    model, data = tiny_model("qwen3"), batches(3)
    ref, _ = fit(HybridModule(copy.deepcopy(model), fraction, schedule=True), data, gradient_clip_val=0.05)
    lt, trainer = fit(HybridModule(copy.deepcopy(model), fraction, schedule=True), data, "lazytrain",
                      gradient_clip_val=0.05)
    assert trainer.strategy.last_step_stats["d2h_gib"] > 0
    assert all(p.grad is None for p in lt.parameters()), "direct updates leave no fp32 .grad behind"
    assert rel_diff(ref.model, model) > 1e-3
    assert rel_diff(lt.model, ref.model) <= 1e-5


def test_direct_updates_match_torch_adamw():
    model, data = tiny_model("qwen2-tied"), batches(3)
    ref, _ = fit(LMModule(copy.deepcopy(model)), data, gradient_clip_val=0.05)
    lt, _ = fit(HybridModule(copy.deepcopy(model)), data, "lazytrain", gradient_clip_val=0.05)
    assert rel_diff(lt.model, ref.model) <= 1e-5


def test_direct_updates_bf16_mixed_within_bf16_noise():
    model, data = tiny_model("qwen2"), batches(3)
    ref32, _ = fit(HybridModule(copy.deepcopy(model)), data)
    ref16, _ = fit(HybridModule(copy.deepcopy(model)), data, precision="bf16-mixed")
    lt16, _ = fit(HybridModule(copy.deepcopy(model)), data, "lazytrain", precision="bf16-mixed")
    noise = update_rel_diff(model, ref16.model, ref32.model)
    assert 0 < noise < 0.2, "the bf16 noise floor itself must be small for 2x of it to mean anything (0.05 here)"
    assert update_rel_diff(model, lt16.model, ref16.model) <= 2 * noise


def test_nonfinite_step_is_skipped_and_counted():
    model, data = tiny_model("qwen2"), batches(3)
    skip, trainer = fit(HybridModule(copy.deepcopy(model), nan_steps={1}), data, "lazytrain")
    assert trainer.strategy.resume.skipped_steps == 1
    two, _ = fit(HybridModule(copy.deepcopy(model)), [data[0], data[2]], "lazytrain", max_steps=2)
    # the skipped step changed nothing: weights equal a run that never saw batch 1
    assert rel_diff(skip.model, two.model) <= 1e-6


def test_three_nonfinite_steps_in_a_row_abort_naming_the_last_good_checkpoint(tmp_path):
    model, data = tiny_model("qwen2"), batches(6)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    with pytest.raises(RuntimeError, match=r"non-finite[\s\S]*Last good checkpoint: .*step=4\.ckpt") as info:
        fit(HybridModule(copy.deepcopy(model), nan_steps={2, 3, 4}), data, "lazytrain", max_steps=6,
            callbacks=[saver], enable_checkpointing=True)
    path = str(info.value).rsplit("Last good checkpoint: ", 1)[1]
    weights = torch.load(path, weights_only=True)["state_dict"]
    assert all(torch.isfinite(t).all() for t in weights.values())
    before = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(weights[k], before[k]) for k in before), "skipped steps must not touch the weights"


def test_direct_updates_resume_exactly(tmp_path):
    model, data = tiny_model("qwen2"), batches(2)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    straight, _ = fit(HybridModule(copy.deepcopy(model), 1.0), data, "lazytrain", max_steps=4, callbacks=[saver],
                      enable_checkpointing=True)
    resumed = HybridModule(copy.deepcopy(model), 1.0)
    trainer = pl.Trainer(accelerator="cpu", strategy="lazytrain", max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(resumed, loader(data), ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    assert resumed.losses == straight.losses[2:]
    assert rel_diff(resumed.model, straight.model) == 0.0


def test_overlap_off_uses_plain_optimizer_step():
    model, data = tiny_model("qwen2"), batches(3)
    ref, _ = fit(HybridModule(copy.deepcopy(model)), data)
    lt, _ = fit(HybridModule(copy.deepcopy(model)), data, LazyTrainStrategy(overlap_updates=False))
    assert any(p.grad is not None for p in lt.parameters())
    assert rel_diff(lt.model, ref.model) <= 1e-5


def test_eight_bit_loss_curve_close_to_fp32_adamw():
    """Through lazytrain, all-8-bit HybridAdamW follows torch AdamW's loss curve on a learnable task.

    Tolerance: after 30 steps the 8-bit run's mean loss over the last 5 steps is within 10% of AdamW's (both fall
    by more than half), the quantization error of the moments being ~1% per block."""
    from lightning_lazytrain.sft.demo import CountingTask, DemoModule

    def run(optimizer_cls, **okw):
        torch.manual_seed(0)
        module = DemoModule()
        module.configure_optimizers = lambda: optimizer_cls(module.parameters(), lr=3e-3, weight_decay=0.01, **okw)
        data = torch.utils.data.DataLoader(CountingTask(16 * 30, 32, 256), batch_size=16, shuffle=False)
        trainer = pl.Trainer(accelerator="cpu", strategy="lazytrain", max_steps=30, gradient_clip_val=1.0,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(module, data)
        return module.losses

    ref = run(torch.optim.AdamW)
    eight = run(HybridAdamW, eight_bit_fraction=1.0, min_8bit_numel=1024)
    tail = lambda losses: sum(losses[-5:]) / 5
    assert tail(ref) < 0.5 * ref[0] and tail(eight) < 0.5 * eight[0]
    assert abs(tail(eight) - tail(ref)) <= 0.1 * tail(ref)


def test_bf16_true_direct_updates_match_plain_stochastic_rounding():
    model, data = tiny_model("qwen2"), batches(3)
    ref, _ = fit(HybridModule(copy.deepcopy(model), 1.0), data, precision="bf16-true")
    lt, _ = fit(HybridModule(copy.deepcopy(model), 1.0), data, "lazytrain", precision="bf16-true")
    assert next(lt.model.parameters()).dtype == torch.bfloat16
    start = copy.deepcopy(model).to(torch.bfloat16)
    assert rel_diff(ref.model, start) > 1e-3, "the reference run must have moved the weights"
    # Both runs round the same fp32 updates with the same stochastic-rounding stream: no bf16-vs-fp32 noise floor
    # enters (it measures 1.6 here, so 2x of it would pass a run that never updated: update_rel_diff 1.0).
    assert update_rel_diff(start, lt.model, ref.model) <= 1e-2


@pytest.mark.parametrize(("fraction", "precision"), [(0.0, "32-true"), (1.0, "32-true"), (0.0, "bf16-true")])
def test_device_update_path_matches_plain_hybrid_adamw(fraction, precision):
    """Half the units through the device path (on the CPU accelerator: the torch reference update on copies,
    with gradients kept where the backward left them) and half through the kernel: the numbers of a plain run."""
    model, data = tiny_model("qwen2"), batches(3)
    ref, _ = fit(HybridModule(copy.deepcopy(model), fraction, schedule=True), data, precision=precision,
                 gradient_clip_val=0.05)
    strategy, busy = LazyTrainStrategy(device_update_share=0.5), BusySeconds()
    lt, _ = fit(HybridModule(copy.deepcopy(model), fraction, schedule=True), data, strategy,
                precision=precision, gradient_clip_val=0.05, callbacks=[busy])
    # both paths ran: the CPU worker's counters may read 0.0 for a step whose jobs are still running, their sum
    # over the run may not; the device share is queued by the main thread, so every step counts it
    assert busy.device > 0 and busy.cpu > 0
    assert rel_diff(ref.model, model) > 1e-3
    tol = 1e-5 if precision == "32-true" else 1e-2  # bf16-true: stochastic rounding of the same fp32 values
    assert rel_diff(lt.model, ref.model) <= tol


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_device_update_path_writes_the_streamed_copy_under_bf16_mixed(fraction):
    """bf16-mixed: the device path stages fp32 masters, states and the bf16 copy the next forward streams; against
    the same run with every update on the CPU kernel the weights agree to fp32 rounding (a stale bf16 copy gives
    2.4e-3 here, the bf16 noise against plain Lightning 1.5e-3, so only this comparison can see it)."""
    model, data = tiny_model("qwen2"), batches(3)
    runs = [fit(HybridModule(copy.deepcopy(model), fraction, schedule=True), data,
                LazyTrainStrategy(device_update_share=share), precision="bf16-mixed", gradient_clip_val=0.05)[0]
            for share in (0.0, 0.5)]
    assert rel_diff(runs[0].model, model) > 1e-2
    assert rel_diff(runs[1].model, runs[0].model) <= 1e-6


def test_busy_seconds_count_overlapping_jobs_once():
    from lightning_lazytrain.engine.updates.cpu import covered_seconds

    assert covered_seconds([]) == 0.0
    assert covered_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0  # two device jobs in flight overlap
    assert covered_seconds([(1.0, 2.0), (0.0, 4.0)]) == 4.0


def test_split_units_balances_finish_times_in_forward_order():
    from lightning_lazytrain.engine.updates.traffic import UnitTraffic
    from lightning_lazytrain.planning.update_placement import split_by_share, split_units

    units = [UnitTraffic(numel=100, h2d_bytes=600, d2h_bytes=800, grad_bytes=200, stream_bytes=200)
             for _ in range(8)]
    # CPU 100 params/s (1 s a unit), device link 800 B/s (1 s a unit): alternate, the first to the CPU (ties)
    assert split_units(units, 100.0, 800.0, 800.0) == [False, True] * 4
    # a device three times slower gets one unit in four
    assert sum(split_units(units, 100.0, 800.0 / 3, 800.0 / 3)) == 2
    assert split_by_share(units, 0.0) == [False] * 8 and split_by_share(units, 1.0) == [True] * 8
    assert sum(split_by_share(units, 0.25)) == 2


def test_plan_share_uses_the_milp_split(monkeypatch):
    """``device_update_share="plan"``: the device worker gets exactly the units of the MILP's split (a CPU rate,
    fixed here near the link's rate, puts some there, not all), and the numbers stay those of a plain run."""
    from lightning_lazytrain import parallel
    from lightning_lazytrain.planning import update_placement as placement
    from lightning_lazytrain.schedule import milp_updates

    seen, solve, place = {}, milp_updates.solve_updates, parallel.place_updates

    def solve_spy(problem, **kw):
        seen["problem"], seen["split"] = problem, solve(problem, **kw)
        return seen["split"]

    def place_spy(*args):
        placed = place(*args)
        seen["flags"] = placed.on_device
        return placed

    monkeypatch.setattr(placement, "measure_cpu_update_rate", lambda optimizer: 5e9)  # params/s, H200 link: 55 GB/s
    monkeypatch.setattr(placement, "PLANNED_DEVICE_TYPES", ("cuda", "cpu"))  # the MILP's split on the CPU accelerator
    monkeypatch.setattr(placement, "solve_updates", solve_spy)
    monkeypatch.setattr(parallel, "place_updates", place_spy)
    model, data = tiny_model("qwen2"), batches(3)
    ref, _ = fit(HybridModule(copy.deepcopy(model)), data, gradient_clip_val=0.05)
    strategy, busy = LazyTrainStrategy(device_update_share="plan"), BusySeconds()
    lt, _ = fit(HybridModule(copy.deepcopy(model)), data, strategy, gradient_clip_val=0.05, callbacks=[busy])
    want = seen["split"].on_device
    assert 0 < sum(want) < len(want)
    assert seen["flags"] == want
    assert seen["split"].wait_seconds < milp_updates.forward_wait(seen["problem"], [False] * len(want))
    assert busy.device > 0 and busy.cpu > 0
    assert rel_diff(lt.model, ref.model) <= 1e-5


def test_the_default_share_places_no_update_on_the_cpu_accelerator(monkeypatch):
    """The default ``device_update_share="plan"`` asks the MILP on CUDA only: on the CPU accelerator no unit goes to
    the device worker, no scratch update is timed, and the numbers are those of a plain run."""
    from lightning_lazytrain.planning import update_placement as placement

    def no_timing(optimizer):
        raise AssertionError("the CPU update rate was timed for a split on the CPU accelerator")

    monkeypatch.setattr(placement, "measure_cpu_update_rate", no_timing)
    model, data = tiny_model("qwen2"), batches(3)
    ref, _ = fit(HybridModule(copy.deepcopy(model)), data, gradient_clip_val=0.05)
    strategy, busy = LazyTrainStrategy(), BusySeconds()
    assert strategy.engine.device_updates.share == "plan"
    lt, _ = fit(HybridModule(copy.deepcopy(model)), data, strategy, gradient_clip_val=0.05, callbacks=[busy])
    assert busy.device == 0.0 and busy.cpu > 0
    assert rel_diff(lt.model, ref.model) <= 1e-5


def test_update_work_reserve_follows_the_kernel_that_runs(monkeypatch):
    """The plan leaves room for the largest update's temporaries: the torch reference's 48 bytes an element, but
    only a zero gradient's 4 where the fused Triton kernel runs (CUDA, Triton, a layout it knows)."""
    from lightning_lazytrain.engine.updates import device_kernel

    p = torch.zeros(4096)
    opt = HybridAdamW([p], eight_bit_fraction=1.0, min_8bit_numel=1)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(device_kernel, "_triton_kernels", lambda: object())  # as where Triton imports
    assert device_kernel.update_work_bytes(p, opt.state[p], cpu) == 48 * 4096  # the reference runs off CUDA
    assert device_kernel.update_work_bytes(p, opt.state[p], cuda) == 4 * 4096
    odd = HybridAdamW([p], eight_bit_fraction=1.0, min_8bit_numel=1, block_size=100)
    assert device_kernel.update_work_bytes(p, odd.state[p], cuda) == 48 * 4096  # a block the kernel does not take
    fp32 = HybridAdamW([p], eight_bit_fraction=0.0)
    assert device_kernel.update_work_bytes(p, fp32.state[p], cuda) == 4 * 4096
    monkeypatch.setattr(device_kernel, "_triton_kernels", lambda: None)  # no Triton: the reference runs on CUDA too
    assert device_kernel.update_work_bytes(p, opt.state[p], cuda) == 48 * 4096
