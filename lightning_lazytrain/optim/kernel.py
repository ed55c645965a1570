"""Build (once, cached) and call the fused C/OpenMP AdamW kernel through ctypes.

The kernel is plain C (``_adamw_kernel.c`` and its headers), not a torch extension: it needs only a C compiler
with OpenMP at run time (gcc or clang; no ninja, no torch headers) and builds in about a second. It is built once
per code path, with that path's explicit ``-m`` flags (``_PATH_FLAGS``), and the path is chosen at run time from
the CPU's features (``runnable_paths``): the fastest this CPU can run, or the one ``$LAZYTRAIN_KERNEL_PATH``
names (tests and benchmarks force each path so). One shared object per path rather than target attributes or
ifunc: the hand-written loops are selected by the preprocessor and the fp32-state loops are vectorized by the
compiler for the flags of the object they are in, so every path is the same source built differently, and only
the path that runs is built. Shared objects are cached under ``$LAZYTRAIN_CACHE`` (default
``~/.cache/lightning_lazytrain``) keyed by a hash of the sources, the flags and the compiler. ctypes drops the GIL
for the call, so the engine can run updates on worker threads while Python carries on.
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
    "runnable_paths",
    "compile_flags",
    "PATH_ENV",
    "LtArgs",
    "kernel_encode",
    "fast_encoder",
]

_SRC = Path(__file__).with_name("_adamw_kernel.c")
_HEADERS = [Path(__file__).with_name(f"_adamw_{name}.h") for name in ("codec", "cell", "fused8", "avx2", "neon")]
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]
_AVX512 = ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl"]
# path -> (LT_PATH of _adamw_kernel.c, compiler flags, /proc/cpuinfo flags it needs), fastest first per ISA.
_PATH_FLAGS: dict[str, tuple[int, list[str], set[str]]] = {
    "c/avx512vbmi": (
        2,
        [*_AVX512, "-mavx512vbmi"],
        {"avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512vbmi"},
    ),
    "c/avx512f": (1, _AVX512, {"avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl"}),
    "c/avx2": (3, ["-mavx2", "-mfma"], {"avx2", "fma"}),
    "c/neon": (4, [], {"asimd"}),
    "c/scalar": (0, [], set()),
}
_X86_PATHS = ("c/avx512vbmi", "c/avx512f", "c/avx2", "c/scalar")
_ARM_PATHS = ("c/neon", "c/scalar")
PATH_ENV = "LAZYTRAIN_KERNEL_PATH"
_lock = threading.Lock()
log = logging.getLogger(__name__)
_libs: dict[str, ctypes.CDLL] = {}
_errors: dict[str, str] = {}


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


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (x86 ``flags``, Arm ``Features``); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() in ("flags", "Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runnable_paths() -> list[str]:
    """The kernel's code paths this CPU can run, fastest first (``c/scalar`` last: it runs everywhere)."""
    machine = platform.machine().lower()
    candidates = _X86_PATHS if machine in ("x86_64", "amd64") else _ARM_PATHS if machine in ("aarch64", "arm64") else ()
    flags = _cpu_flags()
    return [p for p in candidates if _PATH_FLAGS[p][2] <= flags] + (["c/scalar"] if not candidates else [])


def _chosen_path() -> str:
    forced = os.environ.get(PATH_ENV)
    paths = runnable_paths()
    if not forced:
        return paths[0]
    if forced not in paths:
        raise KernelUnavailable(f"${PATH_ENV}={forced!r} is not a kernel path this CPU runs; it runs {paths}")
    return forced


def compile_flags(path: str) -> list[str]:
    """The compiler flags of the kernel's ``path`` (the test of the NEON path cross-compiles with them)."""
    level, extra, _ = _PATH_FLAGS[path]
    return [*_FLAGS, *extra, f"-DLT_PATH={level}"]


def _build(cc: str, path: str) -> Path:
    flags = compile_flags(path)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(
        b"\0".join(
            [_SRC.read_bytes(), *(h.read_bytes() for h in _HEADERS), " ".join(flags).encode(), str(version).encode()]
        )
    ).hexdigest()[:16]
    cache = Path(os.environ.get("LAZYTRAIN_CACHE", Path.home() / ".cache" / "lightning_lazytrain"))
    out = cache / f"adamw_kernel_{path.split('/')[1]}_{key}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    log.info("building the fused CPU AdamW kernel (%s) with %s -> %s", path, cc, out)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run([cc, *flags, str(_SRC), "-o", str(tmp_out), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelUnavailable(f"building the fused CPU AdamW kernel failed ({cc}):\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders never load a half-written file
    return out


def load_kernel(path: str | None = None) -> ctypes.CDLL:
    """The loaded kernel library of ``path`` (default: the chosen one, see ``kernel_path``), building it on first
    use; raises KernelUnavailable with the reason."""
    with _lock:
        path = path or _chosen_path()
        if path in _libs:
            return _libs[path]
        if path in _errors:
            raise KernelUnavailable(_errors[path])
        try:
            if path not in runnable_paths():
                raise KernelUnavailable(f"kernel path {path!r} does not run on this CPU; it runs {runnable_paths()}")
            cc = find_compiler()
            if cc is None:
                raise KernelUnavailable(
                    "no C compiler found (tried $CC, gcc, cc, clang): the fused CPU AdamW kernel needs one with "
                    "OpenMP, e.g. `apt-get install gcc`; HybridAdamW(use_kernel=False) uses the slow torch path"
                )
            lib = ctypes.CDLL(str(_build(cc, path)))
        except KernelUnavailable as e:
            _errors[path] = str(e)
            raise
        except OSError as e:
            _errors[path] = f"loading the fused CPU AdamW kernel failed: {e}"
            raise KernelUnavailable(_errors[path]) from e
        lib.lt_adamw_step.argtypes = [ctypes.POINTER(LtArgs)]
        lib.lt_adamw_step.restype = ctypes.c_int
        lib.lt_encode.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.lt_encode.restype = None
        lib.lt_fast_encoder.restype = ctypes.c_int
        lib.lt_simd_level.restype = ctypes.c_int
        if lib.lt_simd_level() != _PATH_FLAGS[path][0]:
            raise KernelUnavailable(f"the kernel built for {path} reports path {lib.lt_simd_level()}")
        tabs = [t.contiguous() for s in (True, False) for t in quant_tables(s)]  # code, thr per map
        lib.lt_set_tables(*[ctypes.c_void_p(t.data_ptr()) for t in tabs])
        _libs[path] = lib
        return lib


def kernel_available() -> bool:
    return kernel_path() != "torch"


def kernel_path() -> str:
    """Which update path HybridAdamW takes on CPU tensors here: the kernel's ``c/avx512vbmi``, ``c/avx512f``,
    ``c/avx2``, ``c/neon`` or ``c/scalar`` (the fastest this CPU runs, or ``$LAZYTRAIN_KERNEL_PATH``), or
    ``torch`` (no kernel: the reference path)."""
    try:
        load_kernel()
        return _chosen_path()
    except KernelUnavailable:
        return "torch"


def kernel_encode(x: torch.Tensor, signed: bool, path: str | None = None) -> torch.Tensor:
    """Codes (uint8) the encoder of the kernel's ``path`` (default: the chosen one) gives values already divided
    by their block absmax (CPU fp32)."""
    x = x.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
    out = torch.empty(x.numel(), dtype=torch.uint8)
    load_kernel(path).lt_encode(0 if signed else 1, x.data_ptr(), out.data_ptr(), x.numel())
    return out


def fast_encoder(path: str | None = None) -> bool:
    """Whether the kernel's ``path`` uses its table-driven encoder (AVX-512's, AVX2's cell encoder, NEON's bucket
    encoder) rather than the plain search: a vector path whose map tables passed its checks."""
    return bool(load_kernel(path).lt_fast_encoder())


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
