"""Published figures of the GPUs a plan can be made for without one: memory, dense bf16 peak, host link.

The link figures are the PCIe generation's per-direction rate times what the H200 benchmark machine measured of
its own PCIe gen5 x16 (REFERENCE.md: 55.5 GB/s H2D, 55.3 D2H, 101 both at once, of 63 GB/s per direction).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
PCIE_X16_BYTES_PER_S = {4: 31.5e9, 5: 63.0e9}  # per direction, 128b/130b encoding
H2D_EFFICIENCY, D2H_EFFICIENCY, DUPLEX_EFFICIENCY = 55.5 / 63.0, 55.3 / 63.0, 101.0 / 126.0


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: ``memory_bytes`` as the driver reports it, ``bf16_tflops`` the dense (not sparse) tensor
    peak with fp32 accumulation, ``pcie_gen`` the host link (x16)."""

    name: str
    description: str
    memory_bytes: int
    bf16_tflops: float
    pcie_gen: int

    @property
    def h2d_bytes_per_s(self) -> float:
        return PCIE_X16_BYTES_PER_S[self.pcie_gen] * H2D_EFFICIENCY

    @property
    def d2h_bytes_per_s(self) -> float:
        return PCIE_X16_BYTES_PER_S[self.pcie_gen] * D2H_EFFICIENCY

    @property
    def duplex_bytes_per_s(self) -> float:
        return 2 * PCIE_X16_BYTES_PER_S[self.pcie_gen] * DUPLEX_EFFICIENCY


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("h200", "NVIDIA H200 SXM 141 GB", 143771 * MIB, 989.0, 5),
        GpuSpec("h100", "NVIDIA H100 SXM 80 GB", 81559 * MIB, 989.0, 5),
        GpuSpec("a100-80gb", "NVIDIA A100 SXM 80 GB", 81920 * MIB, 312.0, 4),
        GpuSpec("l40s", "NVIDIA L40S 48 GB", 46068 * MIB, 362.0, 4),
        GpuSpec("rtx4090", "NVIDIA GeForce RTX 4090 24 GB", 24564 * MIB, 165.2, 4),
        GpuSpec("rtx3090", "NVIDIA GeForce RTX 3090 24 GB", 24576 * MIB, 71.0, 4),
    )
}
# words in torch.cuda.get_device_name() that identify a table entry (the measured GPU's published peak)
_DEVICE_WORDS = {
    "h200": ("H200",),
    "h100": ("H100",),
    "a100-80gb": ("A100",),
    "l40s": ("L40S",),
    "rtx4090": ("4090",),
    "rtx3090": ("3090",),
}


def gpu_spec(name: str) -> GpuSpec:
    """The table entry for ``name`` (case-insensitive); ValueError naming the known ones otherwise."""
    spec = GPUS.get(name.strip().lower())
    if spec is None:
        raise ValueError(f"unknown GPU {name!r}: --gpu takes one of {', '.join(GPUS)}")
    return spec


def spec_for_device(device_name: str) -> GpuSpec | None:
    """The table entry a CUDA device name (``torch.cuda.get_device_name``) belongs to, if any."""
    for key, words in _DEVICE_WORDS.items():
        if any(w in device_name for w in words):
            return GPUS[key]
    return None
