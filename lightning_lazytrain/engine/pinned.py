"""Page-locked host buffers, allocated once at setup and released at teardown.

``cudaHostRegister`` of an ordinary allocation pins about 6x faster than ``torch.empty(pin_memory=True)`` on the
H200 host (0.11 vs 0.6-0.9 s per GiB, REFERENCE.md), so that is tried first; the torch allocator is the fallback.
"""

from __future__ import annotations

import torch


class PinnedAllocator:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self._registered: list[torch.Tensor] = []
        self.pinned_bytes = 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.enabled or numel == 0:
            return torch.empty(numel, dtype=dtype)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        tensor = torch.empty(numel, dtype=dtype)
        if not self.register(tensor):
            try:
                tensor = torch.empty(numel, dtype=dtype, pin_memory=True)
            except RuntimeError as exc:
                raise MemoryError(
                    f"lazytrain could not pin {nbytes / 2**30:.2f} GiB of host memory ({self.pinned_bytes / 2**30:.2f}"
                    " GiB pinned so far). Free host RAM, lower the model size, or use precision='bf16-true'."
                ) from exc
            self.pinned_bytes += nbytes
        return tensor

    def register(self, tensor: torch.Tensor) -> bool:
        """Pin memory that already exists (e.g. a shared-memory mapping); False when CUDA refuses."""
        if not self.enabled or tensor.numel() == 0:
            return False
        nbytes = tensor.numel() * tensor.element_size()
        try:
            err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
            ok = int(err) == 0 if not hasattr(err, "value") else err.value == 0
        except (AttributeError, RuntimeError):
            ok = False
        if ok:
            self._registered.append(tensor)
            self.pinned_bytes += nbytes
        return ok

    def release(self) -> None:
        for tensor in self._registered:
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        self._registered.clear()
        self.pinned_bytes = 0
