"""ActivationHomes on the CPU: the same code path as on the GPU, with real spill files."""

import collections
import contextlib
import dataclasses
import errno
import os
import subprocess
import sys
import threading

import pytest
import torch

from lightning_lazytrain.engine.activations import spill as spill_mod
from lightning_lazytrain.engine.activations.homes import ActivationHomes, MissingBoundaryError, SpillError
from lightning_lazytrain.engine.device import DeviceQueues
from lightning_lazytrain.engine.weights.pinned import PinnedAllocator


def make(homes, spill_dir=None, **kw):
    return ActivationHomes(DeviceQueues(torch.device("cpu")), homes, PinnedAllocator(False), spill_dir, **kw)


def spill_files(store):
    return sorted(os.listdir(store.spill.root))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("home", ["gpu", "cpu", "nvme"])
def test_round_trip_is_exact(tmp_path, home, dtype):
    store = make(["gpu", home, "recompute", home], str(tmp_path))
    x1 = torch.randn(2, 5, 7).to(dtype)
    x3 = torch.randn(3, 11).to(dtype)
    expected1, expected3 = x1.clone(), x3.clone()
    store.put(1, x1)
    store.put(3, x3)
    if home != "gpu":  # the home holds its own copy: the producer may reuse its memory at once
        x1.fill_(0)
        x3.fill_(0)
    store.prefetch(3)
    for i, expected in ((3, expected3), (1, expected1)):
        got = store.get(i)
        assert got.dtype == dtype and got.shape == expected.shape
        assert torch.equal(got, expected)
    moved = 0 if home == "gpu" else x1.numel() * x1.element_size() + x3.numel() * x3.element_size()
    stats = store.stats()
    assert stats["offload_bytes"] == stats["reload_bytes"] == moved
    assert stats["nvme_write_bytes"] == stats["nvme_read_bytes"] == (moved if home == "nvme" else 0)
    store.close()


def test_host_buffers_are_allocated_once_and_reused_across_steps(tmp_path):
    store = make(["gpu", "cpu", "nvme", "cpu", "gpu"], str(tmp_path))
    for step in range(3):
        for i in (1, 2, 3):
            store.put(i, torch.full((4, 8), float(step * 10 + i)))
        store.flush()
        for i in (3, 2, 1):
            assert torch.equal(store.get(i), torch.full((4, 8), float(step * 10 + i)))
        # three off-GPU boundaries are live at once at most; whether the NVMe write gives its buffer back before
        # the next put takes one is a race, so the count may be 2 or 3, but it never grows with the steps
        assert store.stats()["host_buffers"] <= 3
    store.close()


def test_spill_files_live_only_between_put_and_get_clear_close(tmp_path):
    store = make(["gpu", "nvme", "nvme", "gpu"], str(tmp_path))
    assert os.path.dirname(store.spill.root) == str(tmp_path)
    assert os.path.basename(store.spill.root).startswith(f"lazytrain-{os.getpid()}-")
    store.put(1, torch.randn(16))
    store.put(2, torch.randn(16))
    store.flush()
    assert spill_files(store) == ["boundary-1.bin", "boundary-2.bin"]
    assert os.path.getsize(os.path.join(store.spill.root, "boundary-1.bin")) == 16 * 4
    store.get(2)
    assert spill_files(store) == ["boundary-1.bin"]
    store.clear()
    assert spill_files(store) == []
    store.put(1, torch.randn(16))
    store.prefetch(2 - 1)
    store.put(2, torch.randn(16))
    root = store.spill.root
    store.close()
    assert not os.path.exists(root)
    assert os.listdir(tmp_path) == []


def test_leftovers_of_dead_processes_are_removed_live_ones_kept(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = tmp_path / f"lazytrain-{child.pid}-abc123"
    dead.mkdir()
    (dead / "boundary-3.bin").write_bytes(b"x" * 10)
    live = tmp_path / f"lazytrain-{os.getpid()}-other"
    live.mkdir()
    unrelated = tmp_path / "lazytrain-notes"
    unrelated.mkdir()
    store = make(["gpu", "nvme", "gpu"], str(tmp_path))
    assert not dead.exists()
    assert live.exists() and unrelated.exists()
    store.close()
    assert live.exists()


def test_nvme_plan_without_spill_dir_is_refused(tmp_path):
    with pytest.raises(ValueError, match="spill_dir"):
        make(["gpu", "nvme", "gpu"], None)
    make(["gpu", "cpu", "gpu"], None).close()  # no NVMe homes: no spill dir needed
    with pytest.raises(SpillError, match="does not exist"):
        make(["gpu", "nvme", "gpu"], str(tmp_path / "not-mounted"))
    assert not (tmp_path / "not-mounted").exists(), "a missing spill dir must not be created"


def test_unwritable_spill_dir_is_refused(tmp_path, monkeypatch):
    def denied(**kw):  # root ignores a read-only mode bit, so simulate what a normal user gets
        raise PermissionError(errno.EACCES, "Permission denied", kw["dir"])

    monkeypatch.setattr(spill_mod.tempfile, "mkdtemp", denied)
    with pytest.raises(SpillError, match=f"spill_dir '{tmp_path}': cannot create the run's folder.*writable"):
        make(["gpu", "nvme", "gpu"], str(tmp_path))


def test_get_of_a_boundary_never_put_names_it(tmp_path):
    store = make(["gpu", "cpu", "gpu", "nvme", "gpu"], str(tmp_path))
    store.put(1, torch.randn(3))
    with pytest.raises(MissingBoundaryError, match="boundary 3 was never put"):
        store.get(3)
    store.get(1)
    with pytest.raises(MissingBoundaryError, match="boundary 1 .*already consumed"):
        store.get(1)
    with pytest.raises(ValueError, match="boundary 2 is planned for recompute"):
        make(["gpu", "cpu", "recompute", "gpu"]).put(2, torch.randn(3))
    store.close()


def test_disk_full_names_dir_bytes_free_and_fix_and_leaves_no_file(tmp_path, monkeypatch):
    def full_disk(fd, data):
        os.write(fd, data[:100])  # a partial file, as a real full disk leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spill_mod, "_write_all", full_disk)
    store = make(["gpu", "nvme", "nvme", "gpu"], str(tmp_path))
    store.put(1, torch.randn(1000))
    with pytest.raises(SpillError) as info:
        store.flush()
    msg = str(info.value)
    assert str(tmp_path) in msg and "asked for 4000 bytes" in msg and "bytes (" in msg.split("available")[0]
    assert "larger disk" in msg and "nvme_activation_gib below the free space" in msg and "'nvme' homes" in msg
    assert spill_files(store) == []
    with pytest.raises(SpillError, match="is full"):  # surfaces at the next put of the forward too
        store.put(2, torch.randn(10))
    with pytest.raises(SpillError, match="boundary 1"):
        store.get(1)
    store.close()
    assert os.listdir(tmp_path) == []


def test_stalled_spill_write_times_out_naming_the_boundary(tmp_path, monkeypatch):
    release = threading.Event()
    real = spill_mod._write_all

    def stalled(fd, data):
        release.wait(10)
        real(fd, data)

    monkeypatch.setattr(spill_mod, "_write_all", stalled)
    store = make(["gpu", "nvme", "gpu"], str(tmp_path), timeout_s=0.2)
    store.put(1, torch.randn(8))
    with pytest.raises(TimeoutError, match="boundary 1"):
        store.get(1)
    release.set()
    store.close()
    assert os.listdir(tmp_path) == []


@dataclasses.dataclass(frozen=True)
class _Mark:
    """A fake event: the stream it was recorded on and how much work had been queued there by then."""

    stream: str
    queued: int

    def query(self) -> bool:
        return True


class _NamedStreamQueues(DeviceQueues):
    """CPU queues whose streams have names and whose events say where and after how much work they were recorded,
    so the order the GPU would see can be checked without one."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.h2d, self.d2h, self.reload = "h2d", "d2h", "reload"
        self.queued: collections.Counter[str] = collections.Counter()
        self.compute_waits: list[_Mark] = []

    def record(self, stream=None, timing=False):
        name = stream or "compute"
        return _Mark(name, self.queued[name])

    def wait(self, event, stream=None):
        if event is not None and stream is None:
            self.compute_waits.append(event)

    @contextlib.contextmanager
    def on(self, stream):
        yield
        self.queued[stream] += 1


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_compute_waits_for_the_reload_on_the_stream_that_ran_it(tmp_path, home):
    """The reload copy runs on the reload stream; ``get`` must order the compute stream after that copy, not after
    whatever the weight stream has done (an event there lets compute read a half-copied boundary on a GPU)."""
    queues = _NamedStreamQueues()
    store = ActivationHomes(queues, ["gpu", home, "gpu"], PinnedAllocator(False), str(tmp_path))
    x = torch.randn(4, 8)
    store.put(1, x)
    store.flush()
    got = store.get(1)
    assert torch.equal(got, x)
    reload_done = _Mark("reload", queues.queued["reload"])
    assert reload_done.queued == 1
    assert reload_done in queues.compute_waits, queues.compute_waits
    store.close()
