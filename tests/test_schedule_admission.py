import pytest

from lightning_lazytrain.admission import admission_report, check_admission, host_bytes_per_param
from lightning_lazytrain.tier_report import AdmissionError

GIB = 1 << 30
HOST_H200 = 125 * GIB


@pytest.mark.parametrize(
    "precision,states,accum,expected",
    [("bf16-mixed", 8, False, 16), ("bf16-mixed", 2, False, 10), ("bf16-true", 2, False, 6),
     ("bf16-mixed", 8, True, 18), ("32-true", 8, False, 16), ("bf16-true", 8, False, 12)],
)
def test_bytes_per_param_match_design(precision, states, accum, expected):
    assert sum(host_bytes_per_param(precision, states, accum).values()) == expected


def test_unknown_precision_refused():
    with pytest.raises(ValueError, match="precision"):
        host_bytes_per_param("fp8")


def _report(params, **kw):
    return admission_report(num_params=params, host_have_bytes=HOST_H200, gpu_have_bytes=80 * GIB,
                            disk_have_bytes=40 * GIB, **kw)


def test_design_examples_7b_fits_every_mode_14b_only_6_bytes():
    for precision, states in (("bf16-mixed", 8), ("bf16-mixed", 2), ("bf16-true", 2)):
        assert _report(7_600_000_000, precision=precision, optimizer_state_bytes_per_param=states).fits
    assert not _report(14_800_000_000, precision="bf16-mixed", optimizer_state_bytes_per_param=8).fits
    assert not _report(14_800_000_000, precision="bf16-mixed", optimizer_state_bytes_per_param=2).fits
    check_admission(num_params=14_800_000_000, host_have_bytes=HOST_H200, gpu_have_bytes=80 * GIB,
                    precision="bf16-true", optimizer_state_bytes_per_param=2)


def test_refusal_has_table_and_suggestions():
    r = _report([400_000_000] * 37, precision="bf16-mixed", optimizer_state_bytes_per_param=8,
                cpu_activation_bytes=10 * GIB, gpu_activation_bytes=90 * GIB, gpu_workspace_bytes=2 * GIB)
    with pytest.raises(AdmissionError) as ei:
        r.check()
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "host RAM short by" in msg and "GPU short by" in msg
    assert "optimizer states" in msg and "CPU activations" in msg and "= need / have" in msg
    assert "8-bit optimizer states" in msg and "bf16-true" in msg and "smaller batch" in msg
    assert "spill dir" in msg


def test_disk_and_frozen_accounting():
    r = _report(1_000_000, frozen_params=GIB, precision="bf16-true", disk_bytes=50 * GIB)
    assert r.tiers["host"].pieces["frozen weights"] == 2 * GIB
    assert r.tiers["disk"].short == 10 * GIB
    assert any("spill dir" in s for s in r.suggestions)
    with pytest.raises(AdmissionError, match="disk short by 10.00 GiB"):
        r.check()


def test_suggestion_marks_enough():
    # 14.8B at 16 B/param is ~220 GiB; bf16-true + 8-bit (6 B) is ~83 GiB and fits 125 GiB.
    r = _report(14_800_000_000)
    combo = [s for s in r.suggestions if s.startswith("bf16-true + 8-bit")]
    assert combo and "(enough)" in combo[0]
    assert all("(enough)" not in s for s in r.suggestions if s.startswith("8-bit"))


def test_kept_graphs_and_the_margin_are_gpu_pieces():
    r = _report(1_000_000, gpu_graph_bytes=30 * GIB, gpu_margin_bytes=4 * GIB, gpu_activation_bytes=50 * GIB)
    gpu = r.tiers["gpu"]
    assert gpu.pieces == {"kept graphs": 30 * GIB, "GPU activations": 50 * GIB, "allocator margin": 4 * GIB}
    assert gpu.short == 84 * GIB - 80 * GIB
    assert "fewer kept graphs (keep_graph_layers, or the plan's keep_graph): frees up to 30.00 GiB (enough)" in (
        r.suggestions
    )
