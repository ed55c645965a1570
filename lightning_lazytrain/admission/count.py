"""Admission control: count host RAM, GPU and disk bytes before step 1 and refuse what cannot fit.

``admission_report`` is pure byte accounting (the forecast calls it for machines it does not run on). Host bytes per
parameter follow DESIGN.md "Memory per parameter": master weights (fp32 4 B, bf16 2 B), the bf16 copy that is
streamed (2 B; none when masters are already bf16 or fp32 is streamed), gradients (bf16 2 B, fp32 4 B when
accumulating or in 32-true), Adam m and v (fp32 8 B, 8-bit 2 B).

``measure.py`` feeds it what a built executor holds.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_lazytrain.tier_report import AdmissionReport, TierUsage
from lightning_lazytrain.units import GIB

PRECISIONS = ("bf16-mixed", "bf16-true", "32-true")


def host_bytes_per_param(precision: str, optimizer_state_bytes_per_param: float = 8.0,
                         grad_accumulation: bool = False) -> dict[str, float]:
    """Host RAM bytes per *trainable* parameter, by piece."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if optimizer_state_bytes_per_param < 0:
        raise ValueError("optimizer_state_bytes_per_param must be >= 0")
    master = 2.0 if precision == "bf16-true" else 4.0
    streamed = 2.0 if precision == "bf16-mixed" else 0.0  # bf16-true streams its masters, 32-true streams fp32
    grads = 4.0 if (grad_accumulation or precision == "32-true") else 2.0
    return {"master weights": master, "streamed bf16 copy": streamed, "gradients": grads,
            "optimizer states": float(optimizer_state_bytes_per_param)}


def _frozen_bytes_per_param(precision: str) -> float:
    # A frozen parameter needs only what is streamed: no gradient, no optimizer state, no fp32 master.
    return 4.0 if precision == "32-true" else 2.0


def _total(params: int | Iterable[int]) -> int:
    n = params if isinstance(params, int) else sum(int(p) for p in params)
    if n < 0:
        raise ValueError("parameter counts must be >= 0")
    return n


def admission_report(
    *,
    num_params: int | Iterable[int],
    host_have_bytes: int,
    gpu_have_bytes: int,
    disk_have_bytes: int = 0,
    frozen_params: int | Iterable[int] = 0,
    frozen_4bit_bytes: int = 0,
    precision: str = "bf16-mixed",
    optimizer_state_bytes_per_param: float = 8.0,
    grad_accumulation: bool = False,
    pinned_slot_bytes: int = 0,
    cpu_activation_bytes: int = 0,
    host_other_bytes: int = 0,
    cpu_device_bytes: int = 0,
    cpu_workspace_bytes: int = 0,
    gpu_slot_bytes: int = 0,
    gpu_resident_bytes: int = 0,
    gpu_workspace_bytes: int = 0,
    gpu_activation_bytes: int = 0,
    gpu_graph_bytes: int = 0,
    gpu_margin_bytes: int = 0,
    disk_bytes: int = 0,
    ranks_per_host: int = 1,
    world_size: int = 1,
    gradient_home: str = "host",
    gradient_staging_bytes: int = 0,
) -> AdmissionReport:
    """Count every tier's bytes for a configuration.

    Args:
        num_params: trainable parameter count, or per-layer counts (summed).
        frozen_params: parameters that are streamed but not trained (no grads / states), in the stream dtype.
        frozen_4bit_bytes: the bytes of a 4-bit (QLoRA) base as the store holds it: packed codes, quant state and
            alignment (``engine/weights/packed4bit.py``); its parameters are not in ``frozen_params``.
        pinned_slot_bytes: host staging buffers beyond the parameter store (e.g. grad bounce buffers).
        cpu_activation_bytes: boundaries the schedule homes in pinned CPU memory.
        host_other_bytes: anything else the caller knows of (dataloader workers, tokenizer, ...).
        cpu_device_bytes / cpu_workspace_bytes: a run on the CPU accelerator, whose "device" is the host: its
            device copies (weight slots, resident parts), and the step's largest transient (one unit's gradients
            as autograd makes them, before the sink takes them).
        gpu_slot_bytes / gpu_resident_bytes / gpu_graph_bytes / gpu_workspace_bytes / gpu_activation_bytes /
            gpu_margin_bytes: the GPU weight slots, parts kept on the GPU (embeddings, head, norms), graphs kept to
            the backward, peak workspace, GPU-homed boundaries, room left for the allocator's rounding.
        disk_bytes: NVMe-homed boundaries in the spill dir.
        ranks_per_host / world_size: several processes (``world_size > 1``) count one host: the streamed copy
            once (it is shared), masters / gradients / states as the host's ``ranks_per_host / world_size`` share.
        gradient_home: where the gradients wait for the norm (``engine/grads/homes.py``): off the host
            (``"device"``, ``"nvme"``) the host holds only ``gradient_staging_bytes`` of staging buffers for them,
            the GPU tier counts them under ``"device"`` and the disk tier under ``"nvme"``.
        host_have_bytes / gpu_have_bytes / disk_have_bytes: what the machine offers.
    """
    trainable, frozen = _total(num_params), _total(frozen_params)
    per = host_bytes_per_param(precision, optimizer_state_bytes_per_param, grad_accumulation)
    host = TierUsage("host RAM", int(host_have_bytes))
    if world_size > 1:
        host.pieces.update(_sharded_host_pieces(per, trainable, frozen, precision, ranks_per_host / world_size))
    else:
        for piece, b in per.items():
            if b:
                host.pieces[piece] = int(b * trainable)
        if frozen:
            host.pieces["frozen weights"] = int(_frozen_bytes_per_param(precision) * frozen)
        if frozen_4bit_bytes:
            host.pieces["4-bit frozen weights"] = int(frozen_4bit_bytes)
    grad_bytes = host.pieces.pop("gradients", 0) if gradient_home != "host" else 0
    for piece, b in (("gradient staging", gradient_staging_bytes if gradient_home != "host" else 0),
                     ("pinned slots", pinned_slot_bytes), ("CPU activations", cpu_activation_bytes),
                     ("CPU run: device copies", cpu_device_bytes),
                     ("CPU run: step workspace", cpu_workspace_bytes), ("other", host_other_bytes)):
        if b:
            host.pieces[piece] = int(b)
    gpu = TierUsage("GPU", int(gpu_have_bytes), {k: int(v) for k, v in (
        ("weight slots", gpu_slot_bytes), ("resident parts", gpu_resident_bytes), ("kept graphs", gpu_graph_bytes),
        ("workspace", gpu_workspace_bytes), ("GPU activations", gpu_activation_bytes),
        ("gradients (device home)", grad_bytes if gradient_home == "device" else 0),
        ("allocator margin", gpu_margin_bytes)) if v})
    disk = TierUsage("disk", int(disk_have_bytes), {k: int(v) for k, v in (
        ("NVMe activations", disk_bytes), ("NVMe gradients", grad_bytes if gradient_home == "nvme" else 0)) if v})
    settings = {"trainable_params": trainable, "frozen_params": frozen, "frozen_4bit_bytes": frozen_4bit_bytes,
                "precision": precision,
                "optimizer_state_bytes_per_param": optimizer_state_bytes_per_param,
                "grad_accumulation": grad_accumulation, "host_bytes_per_param": sum(per.values()),
                "ranks_per_host": ranks_per_host, "world_size": world_size, "gradient_home": gradient_home}
    report = AdmissionReport({"host": host, "gpu": gpu, "disk": disk}, [], settings)
    # savings scale with the host's share of the sharded pieces
    counted = trainable if world_size == 1 else int(trainable * ranks_per_host / world_size)
    report.suggestions = _suggest(report, per, counted, disk_have_bytes - disk_bytes)
    return report


def _sharded_host_pieces(per: dict[str, float], trainable: int, frozen: int, precision: str,
                         share: float) -> dict[str, int]:
    """One host of a multi-process run: the shared streamed copy once, this host's share of everything sharded.

    Where the masters are what is streamed (``32-true``, ``bf16-true``) the shared copy *is* the masters (each
    rank's master shard is its slice of it); under ``bf16-mixed`` every parameter also has an fp32 master shard.
    """
    streamed = _frozen_bytes_per_param(precision) * (trainable + frozen)
    pieces = {"streamed copy (shared, once per host)": int(streamed)}
    if per["streamed bf16 copy"]:
        pieces["master weight shards"] = int(per["master weights"] * (trainable + frozen) * share)
    pieces["gradient shards"] = int(per["gradients"] * trainable * share)
    if per["optimizer states"]:
        pieces["optimizer state shards"] = int(per["optimizer states"] * trainable * share)
    return pieces


def _suggest(r: AdmissionReport, per: dict[str, float], trainable: int, disk_free: int) -> list[str]:
    """What single change would close each shortfall; says '(enough)' when it alone would make the tier fit."""
    out = []
    s = r.settings
    cur = sum(per.values())

    def note(saving: float, short: int) -> str:
        return f"saves {saving / GIB:.2f} GiB" + (" (enough)" if saving >= short else " (not enough alone)")

    host, gpu, disk = r.tiers["host"], r.tiers["gpu"], r.tiers["disk"]
    if host.short:
        if s["optimizer_state_bytes_per_param"] > 2:
            save = (s["optimizer_state_bytes_per_param"] - 2) * trainable
            out.append(f"8-bit optimizer states (2 B/param instead of {s['optimizer_state_bytes_per_param']:g}): "
                       f"{note(save, host.short)}")
        if s["precision"] != "bf16-true":
            alt = sum(host_bytes_per_param("bf16-true", s["optimizer_state_bytes_per_param"],
                                           s["grad_accumulation"]).values())
            saving = note((cur - alt) * trainable, host.short)
            out.append(f"precision='bf16-true' (bf16 masters, stochastic rounding): {saving}")
            both = sum(host_bytes_per_param("bf16-true", min(2, s["optimizer_state_bytes_per_param"]),
                                            s["grad_accumulation"]).values())
            if both < alt:
                out.append(f"bf16-true + 8-bit states ({both:g} B/param): {note((cur - both) * trainable, host.short)}")
        if s["grad_accumulation"] and per["gradients"] > 2 and s["precision"] != "32-true":
            out.append(f"no gradient accumulation (bf16 grads): {note(2 * trainable, host.short)}")
        if "gradients" in host.pieces and not s["grad_accumulation"] and s["world_size"] == 1:
            out.append(f"gradient_home='device' or 'nvme' (with a spill_dir): gradients off the host, "
                       f"{note(host.pieces['gradients'], host.short)}")
        act = host.pieces.get("CPU activations", 0)
        if act:
            where = "move them to a spill dir" if disk_free >= act else "add a spill dir for them"
            out.append(f"smaller batch or fewer CPU-homed boundaries ({where}): frees up to {act / GIB:.2f} GiB"
                       + (" (enough)" if act >= host.short else ""))
    if gpu.short:
        act = gpu.pieces.get("GPU activations", 0)
        if act:
            out.append(f"smaller batch, or a plan with fewer GPU-homed boundaries (more CPU/NVMe/recompute): frees up "
                       f"to {act / GIB:.2f} GiB" + (" (enough)" if act >= gpu.short else ""))
        if graphs := gpu.pieces.get("kept graphs", 0):
            out.append(f"fewer kept graphs (keep_graph_layers, or the plan's keep_graph): frees up to "
                       f"{graphs / GIB:.2f} GiB" + (" (enough)" if graphs >= gpu.short else ""))
        ws = gpu.pieces.get("workspace", 0)
        if ws:
            out.append(f"smaller batch or sequence (workspace {ws / GIB:.2f} GiB scales with tokens)")
    if disk.short:
        out.append(f"a spill dir with {disk.short / GIB:.2f} GiB more free space, or fewer NVMe-homed boundaries")
    return out


def check_admission(**kwargs) -> AdmissionReport:
    """``admission_report(**kwargs)`` then ``check()``; returns the report when it fits."""
    r = admission_report(**kwargs)
    r.check()
    return r
