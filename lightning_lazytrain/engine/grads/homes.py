"""Where a unit's gradients wait between its backward and its update: the gradient home, a plan decision.

With clipping no update may start before the global norm is known, so every unit's gradients wait somewhere from
their backward until the norm has been summed over all of them (on the device, as they arrive: the norm stays
exact and global whatever the home):

- ``"host"``: a pinned host buffer per unit (2 bytes a parameter in bf16), filled on the D2H stream during the
  backward; the update reads it in place. The host holds the whole model's gradients.
- ``"device"``: the gradients stay on the device until the norm is known; then each unit's are copied into one of a
  few pinned staging buffers just ahead of its update, in update order. The device holds them (the plan's budget
  is that much smaller); the host holds only the staging buffers.
- ``"nvme"``: copied to a staging buffer during the backward and written to a file in the spill dir; read back into
  a staging buffer just ahead of the update. Neither the host nor the device holds them.

``"plan"`` (the strategy's default) takes the host when the host RAM left after the run's other pieces holds them,
else the device when they fit beside the plan, else NVMe when there is a spill dir (``choose_gradient_home``).
A unit whose update runs on the device (``updates/device.py``) keeps its gradients there whatever the home.
"""

from __future__ import annotations

from typing import Literal

from lightning_lazytrain.engine.weights.layout import ParamEntry, ParamUnit

GradientHome = Literal["plan", "device", "host", "nvme"]
GRADIENT_HOMES = ("plan", "device", "host", "nvme")
STAGED_HOMES = ("device", "nvme")  # the homes whose update reads a staging buffer
STAGING_BUFFERS = 2  # one piece copied in while the one before is updated
#: of the host RAM available after the run's other pieces, what ``"plan"`` leaves beside the gradients for the rest
#: of the run (CPU activation homes, the data loader, the CUDA context)
HOST_HEADROOM_SHARE = 0.1
#: of the device memory free at setup, what ``"plan"`` lets kept gradients take (the rest is the activation plan's)
DEVICE_SHARE_OF_FREE = 0.5


def check_gradient_home(home: str) -> GradientHome:
    """The strategy's ``gradient_home``, or a ValueError naming the choices."""
    if home not in GRADIENT_HOMES:
        raise ValueError(f"gradient_home must be one of {GRADIENT_HOMES} ('plan': the one that fits), got {home!r}")
    return home  # type: ignore[return-value]


def choose_gradient_home(
    grad_bytes: int, host_left_bytes: int, device_free_bytes: int | None, spill_dir: str | None
) -> str:
    """``"plan"``'s choice: the host when ``grad_bytes`` fit the host RAM left after the run's other pieces, else
    the device when they fit ``DEVICE_SHARE_OF_FREE`` of its free memory (``None``: no device beside the host),
    else NVMe with a spill dir, else the host (admission then refuses, naming the other homes)."""
    if grad_bytes <= host_left_bytes:
        return "host"
    if device_free_bytes is not None and grad_bytes <= DEVICE_SHARE_OF_FREE * device_free_bytes:
        return "device"
    return "nvme" if spill_dir is not None else "host"


def staging_numel(units: list[ParamUnit]) -> int:
    """Elements of one staging buffer: the largest layer unit's trainable prefix, or the largest single parameter
    when that is larger (the resident unit's embedding); a unit larger than a buffer is staged in pieces."""
    layers = [u.trainable_numel for u in units[1:]] or [0]
    largest_entry = max((e.numel for u in units for e in u.trained), default=0)
    return max(max(layers), largest_entry)


def pieces(unit: ParamUnit, capacity: int) -> list[list[int]]:
    """``unit``'s trained entries (indices into ``unit.unique``) grouped, in layout order, into runs of the flat
    layout of at most ``capacity`` elements: each piece is staged, and updated, on its own."""
    out: list[list[int]] = []
    start = None
    for i, entry in enumerate(unit.unique):
        if entry.offset >= unit.trainable_numel:
            continue
        if start is None or entry.offset + entry.numel - start > capacity:
            out.append([])
            start = entry.offset
        out[-1].append(i)
    return out


def piece_span(unit: ParamUnit, piece: list[int]) -> tuple[int, int]:
    """(first element, element count) of ``piece`` in ``unit``'s flat layout."""
    first: ParamEntry = unit.unique[piece[0]]
    last: ParamEntry = unit.unique[piece[-1]]
    return first.offset, last.offset + last.numel - first.offset
