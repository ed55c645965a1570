"""AtomicCheckpointIO: a kill -9 at any moment of a save leaves a loadable checkpoint; damage is refused by name."""

import hashlib
import json
import os
import pathlib
import random
import signal
import time

import lightning.pytorch as pl
import pytest
import torch
from helpers import LMModule, batches, loader, rel_diff, tiny_model, train
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import lightning_lazytrain
from lightning_lazytrain import AtomicCheckpointIO, CorruptCheckpointError, LazyTrainStrategy, find_last_good
from lightning_lazytrain.checkpoint.atomic import _HashingWriter, manifest_path, remove_stale_temps, verify_checkpoint


def payload(tag: int, numel: int = 1000) -> dict:
    return {"w": torch.full((numel,), float(tag)), "tag": tag, "global_step": tag}


def saved(tmp_path, tag=1, name="a.ckpt", numel=1000):
    path = str(tmp_path / name)
    AtomicCheckpointIO().save_checkpoint(payload(tag, numel), path)
    return path


def run_child(save, kill_after=None):
    """Fork; the child runs ``save()`` and exits 0. Returns the child's wait status after an optional SIGKILL.

    The kill timer starts when the child says it is about to save, so fork and scheduling delays do not shift it."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.write(ready_w, b"s")
            save()
        finally:
            os._exit(0)
    os.close(ready_w)
    os.read(ready_r, 1)
    os.close(ready_r)
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def test_save_writes_a_manifest_matching_the_bytes_and_loads_back(tmp_path):
    path = saved(tmp_path, tag=3)
    data = pathlib.Path(path).read_bytes()
    manifest = json.loads(pathlib.Path(manifest_path(path)).read_text())
    assert manifest["accepts"] == [{"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    assert manifest["global_step"] == 3 and manifest["file"] == "a.ckpt"
    loaded = AtomicCheckpointIO().load_checkpoint(path)
    assert loaded["tag"] == 3 and torch.equal(loaded["w"], torch.full((1000,), 3.0))
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "a.ckpt.manifest.json"]


def test_kill_at_every_step_of_a_save_leaves_old_or_new(tmp_path, monkeypatch):
    """Every write, fsync and rename of a save is a kill point; the checkpoint rename is where old turns new."""
    path = saved(tmp_path, tag=1)
    events = []
    real_replace, real_fsync, real_write = os.replace, os.fsync, _HashingWriter.write

    def instrument(kill_at):
        def hit(name):
            events.append(name)
            if len(events) - 1 == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        monkeypatch.setattr(os, "replace", lambda s, d: (hit(("replace", os.fspath(d))), real_replace(s, d))[1])
        monkeypatch.setattr(os, "fsync", lambda fd: (hit(("fsync",)), real_fsync(fd))[1])
        monkeypatch.setattr(_HashingWriter, "write", lambda self, b: (hit(("write",)), real_write(self, b))[1])

    instrument(kill_at=None)
    AtomicCheckpointIO().save_checkpoint(payload(1), path)
    probe = list(events)
    monkeypatch.undo()
    rename_at = probe.index(("replace", path))
    assert probe.count(("replace", manifest_path(path))) == 2
    assert probe.count(("fsync",)) == 6  # temp file; manifest + dir; dir after the rename; manifest + dir
    assert AtomicCheckpointIO().load_checkpoint(path)["tag"] == 1

    for kill_at in range(len(probe)):
        AtomicCheckpointIO().save_checkpoint(payload(1), path)
        events.clear()

        def save(kill_at=kill_at):
            instrument(kill_at)
            AtomicCheckpointIO().save_checkpoint(payload(100 + kill_at), path)

        status = run_child(save)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, kill_at
        tag = AtomicCheckpointIO().load_checkpoint(path)["tag"]
        assert tag == (1 if kill_at <= rename_at else 100 + kill_at), (kill_at, probe[kill_at], tag)


def test_kill_before_the_rename_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    path = saved(tmp_path, tag=1)
    real_replace = os.replace

    def save():
        def replace(src, dst):
            if os.fspath(dst) == path:
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        AtomicCheckpointIO().save_checkpoint(payload(2), path)

    assert os.WTERMSIG(run_child(save)) == signal.SIGKILL
    stale = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(stale) == 1 and stale[0].startswith(".a.ckpt."), "the killed save left its complete temp file"
    manifest = json.loads(pathlib.Path(manifest_path(path)).read_text())
    assert len(manifest["accepts"]) == 2, "the manifest already accepts the new bytes beside the old"
    assert AtomicCheckpointIO().load_checkpoint(path)["tag"] == 1
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")], "loading (a resume) removes the dead temp"
    AtomicCheckpointIO().save_checkpoint(payload(3), path)
    assert len(json.loads(pathlib.Path(manifest_path(path)).read_text())["accepts"]) == 1


def test_kill_at_random_moments_of_repeated_saves(tmp_path):
    numel = 2_000_000  # 8 MB: a save takes long enough for a random kill to land inside it
    path = saved(tmp_path, tag=0, numel=numel)
    durations, old = [], payload(0, numel)  # tensors made in the child could deadlock in the forked thread pool
    for _ in range(3):  # a save as the children run it: forked, with this disk's fsync
        t0 = time.perf_counter()
        run_child(lambda: AtomicCheckpointIO().save_checkpoint(old, path))
        durations.append(time.perf_counter() - t0)
    duration = sorted(durations)[1]
    rng = random.Random(0)
    trials, survivors, last_good = 24, [], 0
    for trial in range(1, trials + 1):
        new = payload(trial, numel)
        stratum = (trial - 1 + rng.random()) / trials  # one random moment in each 24th of 0..1.3 saves
        run_child(lambda new=new: AtomicCheckpointIO().save_checkpoint(new, path), kill_after=stratum * 1.3 * duration)
        loaded = AtomicCheckpointIO().load_checkpoint(path)
        assert loaded["tag"] in (last_good, trial), (trial, loaded["tag"], last_good)
        assert torch.equal(loaded["w"], torch.full((numel,), float(loaded["tag"])))
        survivors.append("new" if loaded["tag"] == trial else "old")
        last_good = loaded["tag"]
    assert {"old", "new"} <= set(survivors), (survivors, durations)  # kills landed both before and after the rename


def test_flipped_byte_is_a_checksum_mismatch_caught_before_unpickling(tmp_path, monkeypatch):
    path = saved(tmp_path)
    data = bytearray(pathlib.Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    pathlib.Path(path).write_bytes(data)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load ran on an unverified file"))
    with pytest.raises(CorruptCheckpointError, match=r"a\.ckpt is corrupt \(checksum mismatch\)") as info:
        AtomicCheckpointIO().load_checkpoint(path)
    assert path in str(info.value) and "find_last_good" in str(info.value)


def test_truncated_and_extended_files_report_the_sizes(tmp_path):
    path = saved(tmp_path)
    size = os.path.getsize(path)
    os.truncate(path, 100)
    with pytest.raises(CorruptCheckpointError, match=rf"\(truncated\): {size} bytes expected, 100 bytes found"):
        AtomicCheckpointIO().load_checkpoint(path)
    path = saved(tmp_path, name="b.ckpt")
    with open(path, "ab") as f:
        f.write(b"x")
    with pytest.raises(CorruptCheckpointError, match=rf"\(size mismatch\): {size} bytes expected, {size + 1}"):
        verify_checkpoint(path)


def test_missing_or_foreign_manifest_is_refused(tmp_path):
    path = saved(tmp_path)
    os.remove(manifest_path(path))
    with pytest.raises(CorruptCheckpointError, match=r"a\.ckpt has no manifest"):
        AtomicCheckpointIO().load_checkpoint(path)
    pathlib.Path(manifest_path(path)).write_text('{"accepts": []}')
    with pytest.raises(CorruptCheckpointError, match="not a lightning-lazytrain manifest"):
        verify_checkpoint(path)
    pathlib.Path(manifest_path(path)).write_text("{")
    with pytest.raises(CorruptCheckpointError, match="unreadable"):
        verify_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        verify_checkpoint(tmp_path / "nope.ckpt")


def test_find_last_good_skips_newer_damaged_ones_with_a_warning(tmp_path):
    assert find_last_good(tmp_path) is None and find_last_good(tmp_path / "missing") is None
    first, second, third = (saved(tmp_path, tag=i, name=f"s{i}.ckpt") for i in (1, 2, 3))
    assert find_last_good(tmp_path) == third
    os.truncate(third, 10)
    (tmp_path / "foreign.ckpt").write_bytes(b"not ours")
    with pytest.warns(UserWarning) as record:
        assert find_last_good(tmp_path) == second
    messages = " ".join(str(w.message) for w in record)
    assert "s3.ckpt" in messages and "truncated" in messages and "foreign.ckpt" in messages
    assert first != second


def test_unloadable_objects_are_refused_at_save_time(tmp_path):
    path = tmp_path / "bad.ckpt"
    with pytest.raises(TypeError, match=r"checkpoint\['hparams'\]\['root'\] is a pathlib\.\w*Path"):
        AtomicCheckpointIO().save_checkpoint({"hparams": {"root": pathlib.Path("/x")}}, path)
    assert os.listdir(tmp_path) == []


def test_remove_deletes_the_manifest_and_stale_cleanup_spares_live_writers(tmp_path):
    path = saved(tmp_path)
    AtomicCheckpointIO().remove_checkpoint(path)
    assert os.listdir(tmp_path) == []
    dead = run_child_pid()
    for pid in (dead, os.getpid()):
        (tmp_path / f".x.ckpt.{pid}.0123456789abcdef.tmp").write_bytes(b"partial")
    (tmp_path / "keep.tmp").write_bytes(b"")
    removed = remove_stale_temps(tmp_path)
    assert [os.path.basename(p) for p in removed] == [f".x.ckpt.{dead}.0123456789abcdef.tmp"]
    assert sorted(os.listdir(tmp_path)) == sorted([f".x.ckpt.{os.getpid()}.0123456789abcdef.tmp", "keep.tmp"])


def run_child_pid():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_remote_paths_are_refused():
    with pytest.raises(ValueError, match="local files only"):
        AtomicCheckpointIO().save_checkpoint({}, "s3://bucket/x.ckpt")


def test_strategy_uses_atomic_io_by_default_also_under_async():
    assert lightning_lazytrain.AtomicCheckpointIO is AtomicCheckpointIO
    assert type(LazyTrainStrategy().checkpoint_io) is AtomicCheckpointIO
    strategy = LazyTrainStrategy()
    strategy.checkpoint_io = AsyncCheckpointIO()
    assert type(strategy.checkpoint_io.checkpoint_io) is AtomicCheckpointIO


def test_fit_last_skips_a_corrupt_last_ckpt(tmp_path):
    """3 steps checkpointed every step, last.ckpt damaged, fit(ckpt_path="last") to step 4: resumes from the step-3
    file (with a warning naming last.ckpt) and ends where 4 unbroken steps end."""
    model, data = tiny_model("qwen2"), batches(3)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True, save_top_k=-1)
    train(model, data, strategy="lazytrain", max_steps=3, callbacks=[saver], enable_checkpointing=True)
    assert os.path.exists(manifest_path(tmp_path / "epoch=0-step=3.ckpt"))
    last = tmp_path / "last.ckpt"
    blob = bytearray(last.read_bytes())
    blob[-100] ^= 1
    last.write_bytes(blob)
    straight, _ = train(model, data, strategy="lazytrain", max_steps=4)
    resumed = LMModule(tiny_model("qwen2", seed=9))  # other initial weights: the checkpoint must replace them
    trainer = pl.Trainer(accelerator="cpu", strategy="lazytrain", max_steps=4, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    with pytest.warns(UserWarning, match=r"last\.ckpt is corrupt, resuming from .*epoch=0-step=3\.ckpt"):
        trainer.fit(resumed, loader(data), ckpt_path="last")
    assert resumed.losses == straight.losses[3:]
    assert rel_diff(resumed.model, straight.model) == 0.0


def test_fit_with_an_explicit_corrupt_path_raises(tmp_path):
    path = saved(tmp_path, name="epoch=0-step=1.ckpt")
    os.truncate(path, 50)
    trainer = pl.Trainer(accelerator="cpu", strategy="lazytrain", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = LMModule(tiny_model("qwen2"))
    with pytest.raises(CorruptCheckpointError, match=r"epoch=0-step=1\.ckpt is corrupt \(truncated\)"):
        trainer.fit(module, loader(batches(1)), ckpt_path=path)
