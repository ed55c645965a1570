"""The CPU update rate ``lazytrain plan`` forecasts with: measured per kernel path, mixed by the 8-bit fraction,
cached per host; ``--update_gparams_per_s`` overrides it."""

import pytest

from lightning_lazytrain.optim import update_rate
from lightning_lazytrain.optim.kernel import PATH_ENV, find_compiler, kernel_path, runnable_paths
from lightning_lazytrain.sft import plan_command

needs_kernel = pytest.mark.skipif(find_compiler() is None, reason="no C compiler for the fused kernel")


@needs_kernel
def test_rates_mix_by_fraction_and_are_cached_per_path(monkeypatch, tmp_path):
    monkeypatch.setenv("LAZYTRAIN_CACHE", str(tmp_path))
    timed = []

    def fake_time(eight_bit, threads, numel=0):
        timed.append((kernel_path(), eight_bit, threads))
        return 1e9 if eight_bit else 2e9

    monkeypatch.setattr(update_rate, "time_update", fake_time)
    rate, path = update_rate.host_update_rate(0.25, threads=2)
    assert path == kernel_path() and rate == pytest.approx(1 / (0.75 / 2e9 + 0.25 / 1e9))
    assert timed == [(path, False, 2), (path, True, 2)]
    assert update_rate.host_update_rate(1.0, threads=2) == (pytest.approx(1e9), path)  # from the cache
    assert len(timed) == 2
    monkeypatch.setenv(PATH_ENV, "c/scalar")  # another path (or thread count) is measured on its own
    assert update_rate.host_update_rate(0.0, threads=2)[1] == "c/scalar"
    assert timed[2:] == [("c/scalar", False, 2)] and len(runnable_paths()) >= 1


def test_plan_measures_unless_given(monkeypatch):
    asked = []
    monkeypatch.setattr(plan_command, "host_update_rate", lambda f: asked.append(f) or (3e9, "c/avx2"))
    assert plan_command._update_rate(2.5, {}) == (2.5e9, "--update_gparams_per_s") and not asked
    hybrid = {"optimizer": "lightning_lazytrain.optim.HybridAdamW", "optimizer_kwargs": {"eight_bit_fraction": 0.3}}
    assert plan_command._update_rate(None, hybrid) == (3e9, "HybridAdamW measured here, kernel path c/avx2")
    plan_command._update_rate(None, {"optimizer": "torch.optim.AdamW"})
    assert asked == [0.3, 0.0]
