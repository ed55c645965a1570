"""GPU idle time from CUDA events (bracketed layer work per span of the stack), and its absence on the CPU."""

import torch
from helpers import batches, tiny_model, train

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.engine.device import DeviceQueues, busy_idle_seconds


class FakeEvent:
    """A completed timing event at ``t`` seconds (``elapsed_time`` in ms, as CUDA's)."""

    def __init__(self, t: float, done: bool = True) -> None:
        self.t, self.done = t, done

    def elapsed_time(self, other: "FakeEvent") -> float:
        return (other.t - self.t) * 1e3

    def query(self) -> bool:
        return self.done


def _pair(a: float, b: float, done: bool = True):
    return FakeEvent(a), FakeEvent(b, done)


def test_busy_and_idle_from_event_pairs():
    # layers at [0, 1], [1.5, 2.5], [4, 5]: 3 s busy, 2 s of gaps inside the span
    busy, idle = busy_idle_seconds([_pair(0, 1), _pair(1.5, 2.5), _pair(4, 5)])
    assert (round(busy, 9), round(idle, 9)) == (3.0, 2.0)
    assert busy_idle_seconds([]) == (0.0, 0.0)


def test_gaps_between_spans_do_not_count_and_unfinished_spans_wait():
    queues = DeviceQueues(torch.device("cpu"))
    queues.is_cuda = True  # the accounting on fake events: no device needed
    # forward span [0, 2] with a 0.5 s gap; head from 2 to 10 (between spans: neither); backward [10, 13] no gap
    queues._busy = [_pair(0, 1), _pair(1.5, 2), None, _pair(10, 13), None, _pair(20, 21, done=False), None]
    busy, idle = queues.take_busy_idle_seconds()
    assert (round(busy, 9), round(idle, 9)) == (4.5, 0.5)
    assert len(queues._busy) == 2  # the span still running stays for the next step
    queues._busy[0][1].done = True
    assert queues.take_busy_idle_seconds() == (1.0, 0.0) and queues._busy == []


def test_cpu_run_has_no_gpu_idle_metric():
    _, trainer = train(tiny_model("qwen2"), batches(2), strategy=LazyTrainStrategy(), max_steps=2)
    stats = trainer.strategy.last_step_stats
    assert "stall_s" in stats and "gpu_idle_s" not in stats and "gpu_layer_busy_s" not in stats
