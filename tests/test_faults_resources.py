"""Resource faults in a real lazytrain CPU run: a full or vanishing spill disk, a failing pin. Each ends in one
ResourceError that names the resource, the bytes, and what to change, promptly, and leaves no spill file behind."""

import errno
import os
import shutil
import subprocess
import time

import lightning.pytorch as pl
import pytest
import torch
from helpers import batches, small_tmpfs, tiny_model, train

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.engine.weights import pinned as pinned_mod
from lightning_lazytrain.engine.weights.pinned import PinnedAllocator
from lightning_lazytrain.engine.weights.store import HostParamStore
from lightning_lazytrain.faults import PinnedMemoryError, ResourceError, SpillError, human_bytes
from lightning_lazytrain.schedule import Schedule
from lightning_lazytrain.schedule import spill_probe as disk_mod
from lightning_lazytrain.schedule.profile import measure_disk

FS_BYTES = 256 * 1024
# 4 layers, two boundaries on NVMe; with batch 2 x seq 320 x hidden 64 fp32 a boundary is 160 KiB
TIERS = ["gpu", "nvme", "nvme", "gpu", "gpu"]
BIG = 2 * 320 * 64 * 4
# the engine's own waits time out after 600 s: a run that ends within this did not hang on a dead I/O thread
PROMPT_S = 60


@pytest.fixture
def tiny_fs(tmp_path):
    """A 256 KiB tmpfs at ``tmp_path/spill`` (root with CAP_SYS_ADMIN only: skipped elsewhere)."""
    with small_tmpfs(tmp_path / "spill", FS_BYTES) as mnt:
        yield mnt


def _plan(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(Schedule(homes=TIERS, objective=0.0, predicted_exposed_seconds=0.0, status="given").to_json())
    return str(path)


def _run_until_fault(tmp_path, spill, seq, steps=1, callbacks=()):
    """Train the tiny model with NVMe boundaries in ``spill``; the SpillError it ends with and how long it took."""
    strategy = LazyTrainStrategy(schedule=_plan(tmp_path), spill_dir=str(spill))
    start = time.perf_counter()
    with pytest.raises(SpillError) as info:
        train(tiny_model("qwen2"), batches(steps, batch=2, seq=seq), strategy=strategy, max_steps=steps,
              callbacks=list(callbacks))
    return info.value, time.perf_counter() - start


def test_full_spill_disk_names_dir_bytes_and_fix_and_leaves_it_empty(tmp_path, tiny_fs):
    err, seconds = _run_until_fault(tmp_path, tiny_fs, seq=320)
    msg = str(err)
    assert isinstance(err, ResourceError) and isinstance(err, RuntimeError)
    assert err.asked == BIG and f"asked for {BIG} bytes (160.0 KiB)" in msg
    assert err.available is not None and err.available < 2 * BIG and f"{err.available} bytes" in msg
    assert f"spill_dir '{tiny_fs}': is full writing boundary" in msg
    assert "nvme_activation_gib below the free space" in msg and "larger disk" in msg and "'nvme' homes" in msg
    assert seconds < PROMPT_S
    assert os.listdir(tiny_fs) == [] and shutil.disk_usage(tiny_fs).used == 0, "every spill byte was given back"


def test_nvme_gradient_home_on_a_full_disk_is_refused_at_setup_leaving_nothing(tiny_fs):
    """The gradient file (the tiny model's 856 KiB of fp32 gradients) is reserved whole at setup: a disk too small
    stops the run there, before step 1, and leaves the disk as it was."""
    from helpers import LMModule

    from lightning_lazytrain.optim import HybridAdamW

    class Hybrid(LMModule):
        def configure_optimizers(self):
            return HybridAdamW(self.parameters(), lr=1e-3)

    strategy = LazyTrainStrategy(gradient_home="nvme", spill_dir=str(tiny_fs))
    with pytest.raises(SpillError) as info:
        train(tiny_model("qwen2"), batches(1), strategy=strategy, module_cls=Hybrid)
    msg = str(info.value)
    grads = 4 * sum(p.numel() for p in tiny_model("qwen2").parameters())
    assert f"spill_dir '{tiny_fs}': is full writing the gradient file" in msg and f"asked for {grads} bytes" in msg
    assert os.listdir(tiny_fs) == [] and shutil.disk_usage(tiny_fs).used == 0


def test_spill_disk_unmounted_mid_run_is_reported_and_nothing_is_left(tmp_path, tiny_fs):
    class Unmount(pl.Callback):
        steps_done = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:  # step 0 spilled and read back fine; the disk goes away before step 1
                self.steps_done = trainer.global_step
                subprocess.run(["umount", str(tiny_fs)], check=True)

    unmount = Unmount()
    err, seconds = _run_until_fault(tmp_path, tiny_fs, seq=16, steps=3, callbacks=[unmount])
    assert unmount.steps_done == 1
    msg = str(err)
    assert f"spill_dir '{tiny_fs}'" in msg and "disappeared (deleted, or the disk unmounted)" in msg
    assert "keep spill_dir mounted" in msg and "plan without 'nvme' homes" in msg
    assert seconds < PROMPT_S
    assert not os.path.ismount(tiny_fs) and os.listdir(tiny_fs) == [], "nothing was written onto the root disk"


def test_spill_folder_deleted_mid_run_is_reported(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()

    class Delete(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:  # what a tmp cleaner does to an idle-looking folder
                shutil.rmtree(trainer.strategy.executor.homes.spill.root)

    err, _ = _run_until_fault(tmp_path, spill, seq=16, steps=3, callbacks=[Delete()])
    assert f"spill_dir '{spill}': the run's folder" in str(err) and "disappeared" in str(err)
    assert err.available is not None and f"{err.available} bytes" in str(err)
    assert os.listdir(spill) == []


@pytest.fixture
def failing_pin(monkeypatch):
    """CUDA "available", cudaHostRegister refusing, and torch's pinned allocator failing after ``ok`` buffers."""
    state = {"ok": 0}

    def pinned_empty(numel, dtype):
        if state["ok"] == 0:
            raise RuntimeError("CUDA error: out of memory")
        state["ok"] -= 1
        return torch.empty(numel, dtype=dtype)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned_mod, "_register", lambda tensor, nbytes: False)
    monkeypatch.setattr(pinned_mod, "_pinned_empty", pinned_empty)
    return state


def test_pin_failure_names_bytes_asked_pinned_and_what_to_change(failing_pin):
    failing_pin["ok"] = 1
    alloc = PinnedAllocator(enabled=True)
    alloc.empty(1024, torch.float32)  # the first buffer pins
    with pytest.raises(PinnedMemoryError) as info:
        alloc.empty(1 << 20, torch.bfloat16)
    err, msg = info.value, str(info.value)
    assert isinstance(err, ResourceError) and isinstance(err, MemoryError)
    assert err.asked == 2 << 20 and "asked for 2097152 bytes (2.0 MiB)" in msg
    assert "with 4.0 KiB pinned so far" in msg and "CUDA error: out of memory" in msg
    assert err.available and f"{err.available} bytes" in msg
    assert "pin_memory=False" in msg and "ulimit -l" in msg and "cpu_activation_gib" in msg
    assert alloc.pinned_bytes == 4096, "the failed buffer is not counted"


def test_pin_failure_at_setup_reaches_the_caller_unchanged(failing_pin):
    model = tiny_model("qwen2")
    with pytest.raises(PinnedMemoryError, match="pinned host memory: could not page-lock"):
        HostParamStore([("layer.0", [model.model.layers[0]])], torch.float32, torch.bfloat16, pin=True)


@pytest.mark.parametrize(("n", "text"), [(0, "0 bytes"), (1023, "1023 bytes"), (BIG, "160.0 KiB"),
                                         (3 << 30, "3.0 GiB"), (5 << 50, "5120.0 TiB")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_disk_speed_probe_fits_a_small_spill_disk_and_leaves_nothing(tiny_fs):
    read, write = measure_disk(str(tiny_fs), 16 << 20)  # the CPU probe size, 64x this disk
    assert read > 0 and write > 0
    assert os.listdir(tiny_fs) == [] and shutil.disk_usage(tiny_fs).used == 0


def test_disk_speed_probe_on_a_failing_disk_is_a_spill_error(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_mod.os, "write", full)
    with pytest.raises(SpillError, match=f"spill_dir '{tmp_path}': is full writing the disk-speed probe"):
        measure_disk(str(tmp_path), 1 << 20)
    assert os.listdir(tmp_path) == []
