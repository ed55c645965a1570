"""The update-placement MILP against enumerating every CPU/device split of small instances."""

import itertools
import random

import pytest

from lightning_lazytrain.engine.updates.traffic import UnitTraffic
from lightning_lazytrain.planning.update_placement import split_units
from lightning_lazytrain.schedule.milp_updates import UpdateProblem, forward_wait, solve_updates


def simulate(p: UpdateProblem, on_device: tuple[bool, ...]) -> float:
    """The reference timeline, written apart from the module's: per unit the time its worker finishes it, then the
    forward as a chain of (ready, run) events."""
    done, cpu, dev = [], 0.0, 0.0
    for c, d, flag in zip(p.cpu_seconds, p.device_seconds, on_device, strict=True):
        if flag:
            dev += d
            done.append(dev)
        else:
            cpu += c
            done.append(cpu)
    clock = 0.0
    waited = 0.0
    for ready, f in zip(done, p.forward_seconds, strict=True):
        waited += max(0.0, ready - clock)
        clock = max(clock, ready) + f
    return waited


def brute_force(p: UpdateProblem) -> float:
    best = float("inf")
    for split in itertools.product([False, True], repeat=len(p.cpu_seconds)):
        if p.device_bytes is not None and sum(b for b, f in zip(p.device_bytes, split, strict=True) if f) > \
                p.device_budget_bytes:
            continue
        best = min(best, simulate(p, split))
    return best


def random_problem(seed: int) -> UpdateProblem:
    rng = random.Random(seed)
    n = rng.randint(3, 9)
    cpu = [rng.uniform(0.05, 0.3) for _ in range(n)]
    dev = [c * rng.uniform(0.5, 3.0) for c in cpu]
    fwd = [rng.uniform(0.0, 0.2) for _ in range(n)]
    if seed % 3 == 0:  # a device budget that leaves room for about a third of the units
        sizes = [rng.randint(1, 10) for _ in range(n)]
        return UpdateProblem(cpu, dev, fwd, device_bytes=sizes, device_budget_bytes=sum(sizes) // 3)
    return UpdateProblem(cpu, dev, fwd)


@pytest.mark.parametrize("seed", range(24))
def test_update_split_matches_brute_force(seed):
    p = random_problem(seed)
    split = solve_updates(p, mip_gap=0.0)
    best = brute_force(p)
    assert split.status == "optimal"
    assert simulate(p, tuple(split.on_device)) == pytest.approx(best, abs=1e-5)
    assert split.wait_seconds == pytest.approx(best, abs=1e-5)
    if p.device_bytes is not None:
        assert sum(b for b, f in zip(p.device_bytes, split.on_device, strict=True) if f) <= p.device_budget_bytes


def test_instances_are_not_trivial():
    """The splits must matter: all-CPU is worse than the best on most instances, and the greedy balance of
    `split_units` misses the optimum on some (otherwise the MILP would add nothing)."""
    worse_all_cpu = greedy_misses = 0
    for seed in range(24):
        p = random_problem(seed)
        best = brute_force(p)
        worse_all_cpu += simulate(p, (False,) * len(p.cpu_seconds)) > best + 1e-6
        if p.device_bytes is None:
            traffic = [UnitTraffic(numel=round(c * 1e6), h2d_bytes=round(d * 1e6), d2h_bytes=0, grad_bytes=0,
                                   stream_bytes=0)
                       for c, d in zip(p.cpu_seconds, p.device_seconds, strict=True)]
            greedy = split_units(traffic, 1e6, 1e6, 1e6)
            greedy_misses += simulate(p, tuple(greedy)) > best + 1e-4
    assert worse_all_cpu >= 18
    assert greedy_misses >= 1


def test_forward_wait_by_hand():
    """Two units, 1 s each on the CPU, 3 s on the device, forward 0.5 s each: all on the CPU waits 1 s for unit 0
    and 0.5 s for unit 1 (ready at 2, forward reaches it at 1.5); unit 1 on the device waits 1 + 1.5."""
    p = UpdateProblem([1.0, 1.0], [3.0, 3.0], [0.5, 0.5])
    assert forward_wait(p, [False, False]) == pytest.approx(1.5)
    assert forward_wait(p, [False, True]) == pytest.approx(2.5)
    assert solve_updates(p).on_device == [False, False]


def test_slow_forward_hides_everything_on_the_cpu():
    """A forward slower than every CPU update: the CPU alone keeps up, and the tie-breaker keeps the device idle."""
    p = UpdateProblem([0.1] * 6, [0.1] * 6, [1.0] * 6)
    split = solve_updates(p)
    assert split.on_device == [False] * 6 and split.wait_seconds == pytest.approx(0.1)


def test_mismatched_lengths_name_the_field():
    with pytest.raises(ValueError, match="forward_seconds has 2 entries, cpu_seconds has 3"):
        UpdateProblem([1.0] * 3, [1.0] * 3, [1.0] * 2)
