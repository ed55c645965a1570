"""The forecast's gradient home (``lazytrain plan``): where ``gradient_home="plan"`` puts the gradients on a machine,
and what each home does to the host, GPU and disk tiers and to the activation plan's budget."""

from __future__ import annotations

import pytest
from forecast_helpers import GIB, analytic_for, lazytrain_run, machine_of, meta, named

from lightning_lazytrain.schedule.analytic import gpu_layout
from lightning_lazytrain.schedule.forecast import forecast, plan_inputs, staging_bytes
from lightning_lazytrain.schedule.plan_inputs import gpu_total_bytes
from lightning_lazytrain.schedule.plan_problem import plan_total_bytes


@pytest.fixture(scope="module")
def adapter():
    return meta(named("qwen2.5-7b"))


def test_a_host_short_of_the_gradients_plans_them_on_the_gpu(adapter):
    run = lazytrain_run(adapter)
    machine = machine_of(80, host_gib=110)  # 100.5 GiB without the gradients, 114.7 GiB with them
    f = forecast(run, machine, 16, analytic_for(run))
    n, grads = run.trainable_params, 2 * run.trainable_params
    assert f.gradient_home == "device" and f.fits
    host = f.report.tiers["host"]
    assert "gradients" not in host.pieces and host.pieces["gradient staging"] == staging_bytes(run)
    # 2 x the largest parameter (the 152064 x 3584 embedding) in bf16
    assert staging_bytes(run) == 2 * 2 * 152064 * 3584
    assert host.need == pytest.approx(n * (4 + 2 + 7.88) + staging_bytes(run), rel=1e-6)
    assert f.report.tiers["gpu"].pieces["gradients (device home)"] == grads
    resident = gpu_layout(run.adapter, run.stream_dtype).resident_copy_bytes
    assert gpu_total_bytes(plan_inputs(run, machine)) == plan_total_bytes(80 * GIB - resident - grads)
    assert f.report.tiers["gpu"].need <= 80 * GIB


def test_a_gpu_too_small_for_them_spills_them_to_nvme(adapter):
    run = lazytrain_run(adapter, spill_dir="/nvme")
    machine = machine_of(24, host_gib=64)  # 14.2 GiB of gradients > half of 24 GiB
    machine.disk_free_bytes = 100 * GIB
    f = forecast(run, machine, 4, analytic_for(run))
    assert f.gradient_home == "nvme"
    assert f.report.tiers["disk"].pieces["NVMe gradients"] == 2 * run.trainable_params
    assert "gradients (device home)" not in f.report.tiers["gpu"].pieces


def test_a_host_that_holds_them_keeps_them(adapter):
    run = lazytrain_run(adapter)
    f = forecast(run, machine_of(80, host_gib=200), 16, analytic_for(run))
    assert f.gradient_home == "host" and f.report.tiers["host"].pieces["gradients"] == 2 * run.trainable_params
