"""Page-locked host buffers, allocated once at setup and released at teardown.

``cudaHostRegister`` of an ordinary allocation pins about 6x faster than ``torch.empty(pin_memory=True)`` on the
H200 host (0.11 vs 0.6-0.9 s per GiB, REFERENCE.md), so that is tried first; the torch allocator is the fallback.
When both fail the error (:class:`~lightning_lazytrain.faults.PinnedMemoryError`) says how much was asked and what
to change.
"""

from __future__ import annotations

import ctypes
import os

import torch

from lightning_lazytrain.faults import pin_failed

#: the CUDA runtime sonames torch's CUDA builds load, newest first
_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


def _register(tensor: torch.Tensor, nbytes: int) -> bool:
    """Page-lock ``tensor``'s memory in place; False when CUDA refuses (module level: tests simulate a refusal)."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    except (AttributeError, RuntimeError):
        return False
    ok = int(err) == 0 if not hasattr(err, "value") else err.value == 0
    if not ok:
        _clear_last_cuda_error()
    return ok


def _clear_last_cuda_error() -> None:
    """Reset the runtime's last error. A refused ``cudaHostRegister`` leaves it set, and torch's check after the
    next kernel launch would raise it there, far from here (seen on an H100: a sleep kernel failed with "part or
    all of the requested memory range is already mapped"). The runtime torch already loaded is the one to ask."""
    for name in _CUDART_NAMES:
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        runtime.cudaGetLastError()
        return


def _pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


class PinnedAllocator:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self._registered: list[torch.Tensor] = []
        self.pinned_bytes = 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.enabled or numel == 0:
            return torch.empty(numel, dtype=dtype)
        nbytes = numel * dtype.itemsize
        tensor = torch.empty(numel, dtype=dtype)
        if _register(tensor, nbytes):
            self._registered.append(tensor)
        else:
            try:
                tensor = _pinned_empty(numel, dtype)
            except RuntimeError as exc:
                raise pin_failed(nbytes, self.pinned_bytes, exc) from exc
        self.pinned_bytes += nbytes
        return tensor

    def register(self, tensor: torch.Tensor) -> bool:
        """Pin memory that already exists (a shared-memory mapping) in place; False when CUDA refuses."""
        if not self.enabled or tensor.numel() == 0:
            return False
        nbytes = tensor.numel() * tensor.element_size()
        if not _register(tensor, nbytes):
            return False
        self._registered.append(tensor)
        self.pinned_bytes += nbytes
        return True

    def release(self) -> None:
        for tensor in self._registered:
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        self._registered.clear()
        self.pinned_bytes = 0
