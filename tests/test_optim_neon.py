"""The NEON path of the fused AdamW kernel against its scalar path, bit for bit, cross-compiled for aarch64 and
run under qemu-user (x86 hosts), or natively on an Arm host; the checks are in optim_kernel_paths.c."""

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_optim_codec import _encoder_cases

from lightning_lazytrain.optim.kernel import _SRC, compile_flags
from lightning_lazytrain.optim.quant import quant_tables

_NATIVE = platform.machine().lower() in ("aarch64", "arm64")
_CC = shutil.which("gcc" if _NATIVE else "aarch64-linux-gnu-gcc")
_QEMU = None if _NATIVE else shutil.which("qemu-aarch64")
_SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's cross libraries (libc6-arm64-cross, libgomp1-arm64-cross)


@pytest.mark.skipif(
    # .ci/run installs both, so under CI a missing tool fails the test instead of hiding the NEON path
    (_CC is None or (not _NATIVE and _QEMU is None)) and not os.environ.get("CI"),
    reason="no aarch64 C compiler and qemu-aarch64: apt-get install gcc-aarch64-linux-gnu qemu-user",
)
def test_neon_path_is_bitwise_scalar(tmp_path: Path):
    for path in ("c/scalar", "c/neon"):
        out = tmp_path / f"{path[2:]}.so"
        subprocess.run([_CC, *compile_flags(path), str(_SRC), "-o", str(out), "-lm"], check=True)
    driver = tmp_path / "driver"
    source = Path(__file__).with_name("optim_kernel_paths.c")
    subprocess.run([_CC, "-O2", "-std=c11", "-D_GNU_SOURCE", str(source), "-o", str(driver), "-ldl", "-lm"], check=True)
    values = torch.cat([_encoder_cases(True)[0], _encoder_cases(False)[0]])
    tables = torch.cat([t for signed in (True, False) for t in quant_tables(signed)])
    blob = tables.numpy().tobytes() + torch.tensor([values.numel()]).numpy().tobytes() + values.numpy().tobytes()
    (tmp_path / "inputs.bin").write_bytes(blob)
    cmd = [str(driver), str(tmp_path / "scalar.so"), str(tmp_path / "neon.so"), str(tmp_path / "inputs.bin")]
    if _QEMU:
        cmd = [_QEMU, "-L", _SYSROOT, *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bitwise equal" in proc.stdout
