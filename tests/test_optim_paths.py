"""Every code path of the fused AdamW kernel this CPU runs against the scalar path, bit for bit, and how a path is
chosen (the CPU's features, or $LAZYTRAIN_KERNEL_PATH). The NEON path: test_optim_neon.py."""

import pytest
import torch
from test_optim_codec import _encoder_cases

from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.optim import kernel as kernel_module
from lightning_lazytrain.optim.kernel import (
    PATH_ENV,
    KernelUnavailable,
    fast_encoder,
    find_compiler,
    kernel_encode,
    kernel_path,
    runnable_paths,
)

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler for the fused kernel")
VECTOR_PATHS = [p for p in runnable_paths() if p != "c/scalar"]


def _cpu_flags() -> set[str]:
    return kernel_module._cpu_flags()


def test_paths_follow_the_cpu_features():
    paths = runnable_paths()
    assert paths[-1] == "c/scalar"
    flags = _cpu_flags()
    if {"avx2", "fma"} <= flags:  # this machine has AVX-512 and AVX2: both x86 vector paths must be tested here
        assert "c/avx2" in paths
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vbmi"} <= flags:
        assert paths[0] == "c/avx512vbmi"


def test_forced_path_runs_and_is_reported(monkeypatch):
    for path in runnable_paths():
        monkeypatch.setenv(PATH_ENV, path)
        assert kernel_path() == path
        assert HybridAdamW([torch.zeros(3, requires_grad=True)]).kernel_path == path
        assert kernel_module.load_kernel().lt_simd_level() == kernel_module._PATH_FLAGS[path][0]
    monkeypatch.delenv(PATH_ENV)
    assert kernel_path() == runnable_paths()[0]


def test_unknown_forced_path_names_the_variable(monkeypatch):
    monkeypatch.setenv(PATH_ENV, "c/sve")
    with pytest.raises(KernelUnavailable, match=f"{PATH_ENV}='c/sve' is not a kernel path this CPU runs"):
        kernel_module.load_kernel()


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("signed", [True, False])
def test_encoder_is_bitwise_scalar(path, signed):
    assert fast_encoder(path)
    x, _ = _encoder_cases(signed)
    assert torch.equal(kernel_encode(x, signed, path), kernel_encode(x, signed, "c/scalar"))


def _run(path, monkeypatch, param_dtype, grad_dtype, copy, frac, n=3 * 4096 + 123):
    """Every tensor 4 steps write, from fixed inputs: gradients over 8 decades, so that codes use every decade."""
    monkeypatch.setenv(PATH_ENV, path)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen).to(param_dtype)
    opt = HybridAdamW([p], lr=1e-2, eight_bit_fraction=frac, use_kernel=True)
    assert opt.kernel_path == path
    c = torch.empty(n, dtype=torch.bfloat16)
    if copy:
        opt.register_stream_copy(p, c)
    for _ in range(4):
        g = torch.randn(n, generator=gen) * 10 ** (-8 * torch.rand(n, generator=gen))
        opt.step_params([p], 0.37, [g.to(grad_dtype)])
    st = opt.state[p]
    return [p, c if copy else None] + [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor)]


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("frac", [0.0, 1.0])
def test_update_is_bitwise_scalar(monkeypatch, path, param_dtype, grad_dtype, copy, frac):
    ref = _run("c/scalar", monkeypatch, param_dtype, grad_dtype, copy, frac)
    got = _run(path, monkeypatch, param_dtype, grad_dtype, copy, frac)
    assert len(got) == len(ref) == (6 if frac else 4)  # p, copy, then (codes, absmax) or (m, v) per moment
    for a, b in zip(ref, got, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
