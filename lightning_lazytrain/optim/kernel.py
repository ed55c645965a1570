"""Build (once, cached) and call the fused C/OpenMP AdamW kernel through ctypes.

The kernel is plain C (``_adamw_kernel.c``, including the codec ``_adamw_codec.h``), not a torch extension: it
needs only a C compiler with OpenMP at run time (gcc or clang; no ninja, no torch headers) and builds in about a
second. The shared object is cached under ``$LAZYTRAIN_CACHE`` (default ``~/.cache/lightning_lazytrain``) keyed by
a hash of the sources, the flags, the compiler and the CPU's flags, so each machine builds its own
``-march=native`` copy once. ctypes drops the GIL for the call, so the engine can run updates on worker threads
while Python carries on.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .quant import quant_tables

__all__ = [
    "KernelUnavailable",
    "load_kernel",
    "kernel_available",
    "kernel_path",
    "find_compiler",
    "LtArgs",
    "kernel_encode",
    "fast_encoder",
]

_SRC = Path(__file__).with_name("_adamw_kernel.c")
_HEADERS = [Path(__file__).with_name(name) for name in ("_adamw_codec.h", "_adamw_fused8.h")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]
_SIMD_PATHS = {0: "c/scalar", 1: "c/avx512f", 2: "c/avx512vbmi"}
_lock = threading.Lock()
log = logging.getLogger(__name__)
_lib: ctypes.CDLL | None = None
_error: str | None = None


class KernelUnavailable(RuntimeError):
    """The fused CPU kernel could not be built or loaded (no C compiler, no OpenMP, ...)."""


class LtArgs(ctypes.Structure):
    # Must mirror lt_args in _adamw_kernel.c field by field.
    _fields_ = [
        ("p32", ctypes.c_void_p),
        ("p16", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("grad_bf16", ctypes.c_int32),
        ("nthreads", ctypes.c_int32),
        ("m", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("mq", ctypes.c_void_p),
        ("vq", ctypes.c_void_p),
        ("mabs", ctypes.c_void_p),
        ("vabs", ctypes.c_void_p),
        ("copy", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("block", ctypes.c_int64),
        ("decay", ctypes.c_float),
        ("w1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("w2", ctypes.c_float),
        ("neg_step", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("grad_scale", ctypes.c_float),
        ("sr_key", ctypes.c_uint32),
        ("v_floor", ctypes.c_float),
    ]


def find_compiler() -> str | None:
    """The C compiler the kernel builds with ($CC, gcc, cc or clang), or None when there is none."""
    for name in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_tag() -> str:
    # -march=native output depends on the CPU, so the cache key must too (a shared home across machines).
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(
        b"\0".join(
            [
                _SRC.read_bytes(),
                *(h.read_bytes() for h in _HEADERS),
                " ".join(_FLAGS).encode(),
                str(version).encode(),
                _cpu_tag().encode(),
            ]
        )
    ).hexdigest()[:16]
    cache = Path(os.environ.get("LAZYTRAIN_CACHE", Path.home() / ".cache" / "lightning_lazytrain"))
    out = cache / f"adamw_kernel_{key}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    log.info("building the fused CPU AdamW kernel with %s -> %s", cc, out)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run([cc, *_FLAGS, str(_SRC), "-o", str(tmp_out), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelUnavailable(f"building the fused CPU AdamW kernel failed ({cc}):\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders never load a half-written file
    return out


def load_kernel() -> ctypes.CDLL:
    """The loaded kernel library, building it on first use; raises KernelUnavailable with the reason."""
    global _lib, _error
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None:
            raise KernelUnavailable(_error)
        try:
            cc = find_compiler()
            if cc is None:
                raise KernelUnavailable(
                    "no C compiler found (tried $CC, gcc, cc, clang): the fused CPU AdamW kernel needs one with "
                    "OpenMP, e.g. `apt-get install gcc`; HybridAdamW(use_kernel=False) uses the slow torch path"
                )
            lib = ctypes.CDLL(str(_build(cc)))
        except KernelUnavailable as e:
            _error = str(e)
            raise
        except OSError as e:
            _error = f"loading the fused CPU AdamW kernel failed: {e}"
            raise KernelUnavailable(_error) from e
        lib.lt_adamw_step.argtypes = [ctypes.POINTER(LtArgs)]
        lib.lt_adamw_step.restype = ctypes.c_int
        lib.lt_encode.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.lt_encode.restype = None
        lib.lt_fast_encoder.restype = ctypes.c_int
        lib.lt_simd_level.restype = ctypes.c_int
        tabs = [t.contiguous() for s in (True, False) for t in quant_tables(s)]  # code, thr per map
        lib.lt_set_tables(*[ctypes.c_void_p(t.data_ptr()) for t in tabs])
        _lib = lib
        return lib


def kernel_available() -> bool:
    try:
        load_kernel()
        return True
    except KernelUnavailable:
        return False


def kernel_path() -> str:
    """Which update path HybridAdamW takes on CPU tensors here: ``c/avx512vbmi``, ``c/avx512f``, ``c/scalar``
    (the fused kernel as this machine built it) or ``torch`` (no kernel: the reference path)."""
    try:
        return _SIMD_PATHS[load_kernel().lt_simd_level()]
    except KernelUnavailable:
        return "torch"


def kernel_encode(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """Codes (uint8) the kernel's encoder gives values already divided by their block absmax (CPU fp32)."""
    x = x.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
    out = torch.empty(x.numel(), dtype=torch.uint8)
    load_kernel().lt_encode(0 if signed else 1, x.data_ptr(), out.data_ptr(), x.numel())
    return out


def fast_encoder() -> bool:
    """Whether the kernel uses its table-driven encoder (AVX-512 and map tables that passed its checks)."""
    return bool(load_kernel().lt_fast_encoder())


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def run_step(
    *,
    param: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor | None,
    v: torch.Tensor | None,
    mq: torch.Tensor | None,
    vq: torch.Tensor | None,
    mabs: torch.Tensor | None,
    vabs: torch.Tensor | None,
    copy: torch.Tensor | None,
    block: int,
    decay: float,
    beta1: float,
    beta2: float,
    neg_step: float,
    bc2_sqrt: float,
    eps: float,
    grad_scale: float,
    sr_key: int,
    nthreads: int,
    v_floor: float = 0.0,
) -> None:
    """One fused update of a contiguous CPU tensor (all inputs already validated by the optimizer)."""
    lib = load_kernel()
    args = LtArgs(
        p32=_ptr(param) if param.dtype == torch.float32 else None,
        p16=_ptr(param) if param.dtype == torch.bfloat16 else None,
        grad=_ptr(grad),
        grad_bf16=int(grad.dtype == torch.bfloat16),
        nthreads=nthreads,
        m=_ptr(m),
        v=_ptr(v),
        mq=_ptr(mq),
        vq=_ptr(vq),
        mabs=_ptr(mabs),
        vabs=_ptr(vabs),
        copy=_ptr(copy),
        n=param.numel(),
        block=block,
        decay=decay,
        w1=1.0 - beta1,
        beta2=beta2,
        w2=1.0 - beta2,
        neg_step=neg_step,
        bc2_sqrt=bc2_sqrt,
        eps=eps,
        grad_scale=grad_scale,
        sr_key=sr_key & 0xFFFFFFFF,
        v_floor=v_floor,
    )
    if lib.lt_adamw_step(ctypes.byref(args)) != 0:
        raise MemoryError("fused AdamW kernel: could not allocate per-thread scratch")
