"""WeightVersions: the one place that says which version of a unit's host weights is current and whether an update
still writes them (``ParamUnit`` is only the layout). The slot pool and the resident copies read it."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from lightning_lazytrain.engine.device import DeviceQueues
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.engine.weights.slots import SlotPool
from lightning_lazytrain.engine.weights.store import HostParamStore


def _store(master_dtype=torch.float32, stream_dtype=torch.bfloat16) -> HostParamStore:
    torch.manual_seed(0)
    groups = [("resident", [nn.Linear(4, 4)]), ("layer0", [nn.Linear(4, 8)]), ("layer1", [nn.Linear(8, 4)])]
    return HostParamStore(groups, master_dtype, stream_dtype, pin=False)


def test_units_carry_only_their_layout():
    fields = set(ParamUnit.__dataclass_fields__)
    assert fields == {"index", "label", "entries", "numel", "master", "stream", "unique", "trainable_numel"}


def test_store_casts_the_streamed_copy_at_build_and_after_masters_change():
    store = _store()
    unit = store.units[1]
    assert torch.equal(unit.stream, unit.master.to(torch.bfloat16))
    before = store.versions.generation[unit.index]
    unit.master.add_(1.0)  # e.g. a user's optimizer step, or a checkpoint load into the module
    store.versions.refresh(unit)
    assert store.versions.generation[unit.index] == before, "nothing said the masters changed: no new version"
    store.versions.masters_changed()
    store.versions.refresh(unit)
    assert store.versions.generation[unit.index] == before + 1
    assert torch.equal(unit.stream, unit.master.to(torch.bfloat16))
    store.versions.refresh(unit)
    assert store.versions.generation[unit.index] == before + 1, "a current copy is not cast again"


def test_a_reader_waits_for_the_update_that_holds_the_unit_and_the_wait_is_counted():
    store = _store()
    unit, versions = store.units[2], store.versions
    versions.take_wait_seconds()
    started, release = threading.Event(), threading.Event()

    def update():
        started.set()
        release.wait(5)
        unit.master.mul_(2.0)
        unit.stream.copy_(unit.master)
        versions.written(unit)

    before = versions.generation[unit.index]
    with ThreadPoolExecutor(1) as pool:
        versions.hold(unit, pool.submit(update))
        started.wait(5)
        threading.Timer(0.2, release.set).start()
        versions.refresh(unit)  # must block until the update has written the unit
        assert versions.generation[unit.index] == before + 1
        assert torch.equal(unit.stream, unit.master.to(torch.bfloat16))
    assert versions.take_wait_seconds() >= 0.15
    assert versions.take_wait_seconds() == 0.0, "the wait is taken once"


def test_an_update_that_failed_raises_in_the_reader():
    store = _store()
    unit = store.units[1]

    def broken():
        raise RuntimeError("update of layer0 failed")

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(broken)
        while not future.done():
            time.sleep(0.01)
        store.versions.hold(unit, future)
        with pytest.raises(RuntimeError, match="layer0"):
            store.versions.refresh(unit)
    store.versions.refresh(unit)  # raised once; the unit is free again


def test_slot_copy_is_reused_until_the_unit_has_a_new_version():
    store = _store()
    pool = SlotPool(DeviceQueues(torch.device("cpu")), store.versions, 2, max(u.numel for u in store.units),
                    store.stream_dtype)
    unit = store.units[1]
    slot = pool.acquire(unit)
    pool.release(slot)
    assert pool.acquire(unit) is slot and pool.h2d_copies == 1, "a current copy is not copied again"
    pool.release(slot)
    unit.stream.fill_(3.0)
    store.versions.written(unit)
    slot = pool.acquire(unit)
    assert pool.h2d_copies == 2
    assert torch.equal(slot.buffer[: unit.numel], unit.stream)
