"""The 4-bit unit kind: a bitsandbytes ``Params4bit`` held in a unit's flat buffer as bitsandbytes packs it.

A QLoRA base weight is two 4-bit codes per byte plus its quant state (the per-block absmax, itself 8-bit with a
nested fp32 absmax and code under ``compress_statistics``, the 16-entry code, the nested offset). All of it is laid
out as bytes in the unit's streamed buffer, so the unit still moves in one copy (a quarter of a bf16 weight's bytes,
plus about 1/64 of that for the quant state), and the module's parameter and its quant state view those bytes on
the host. On the device, :meth:`Packed4bit.view` wraps the same bytes of a slot as a ``Params4bit`` with a quant
state of device tensors, so bitsandbytes' ``Linear4bit`` dequantizes it with its own kernels (its CPU ops on the
CPU). The layout is read once, at setup; the weight is frozen, so nothing writes it afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 16  # bytes: every part starts where any dtype's view of it is aligned

#: the quant state's tensors, as (where they sit: "" the state itself, "state2" the nested one, attribute)
_STATE_TENSORS = (("", "absmax"), ("", "code"), ("", "offset"), ("state2", "absmax"), ("state2", "code"))


def is_packed_4bit(param: torch.Tensor) -> bool:
    """``param`` is a bitsandbytes 4-bit weight that is already quantized (its data the packed codes)."""
    return bool(getattr(param, "bnb_quantized", False)) and getattr(param, "quant_state", None) is not None


@dataclass(frozen=True)
class _Part:
    owner: str
    name: str
    start: int  # bytes into the parameter's region
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _tensors_of(param: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    """The packed codes and every tensor of the quant state, in layout order."""
    state = param.quant_state
    found = [("", "data", param.data)]
    for owner, name in _STATE_TENSORS:
        holder = state if not owner else getattr(state, owner)
        value = getattr(holder, name, None) if holder is not None else None
        if isinstance(value, torch.Tensor):
            found.append((owner, name, value))
    return found


@dataclass(frozen=True)
class Packed4bit:
    """Where a 4-bit parameter's codes and quant state sit in its region of the flat buffer, and its settings."""

    parts: tuple[_Part, ...]
    nbytes: int
    blocksize: int
    quant_type: str
    compress_statistics: bool
    quant_storage: torch.dtype
    state_shape: torch.Size
    state_dtype: torch.dtype
    nested_blocksize: int | None
    nested_dtype: torch.dtype | None

    @classmethod
    def of(cls, param: torch.Tensor) -> Packed4bit:
        """The layout of a quantized ``Params4bit`` (``is_packed_4bit``), its parts in ``_tensors_of`` order."""
        parts, start = [], 0
        for owner, name, tensor in _tensors_of(param):
            nbytes = tensor.numel() * tensor.element_size()
            parts.append(_Part(owner, name, start, nbytes, tensor.dtype, tensor.shape))
            start += _aligned(nbytes)
        state = param.quant_state
        nested = state.state2
        return cls(tuple(parts), start, state.blocksize, state.quant_type, param.compress_statistics,
                   param.quant_storage, torch.Size(state.shape), state.dtype,
                   nested.blocksize if nested is not None else None, nested.dtype if nested is not None else None)

    def numel(self, itemsize: int) -> int:
        """Elements of a flat buffer of ``itemsize``-byte elements this parameter's region takes."""
        return -(-self.nbytes // itemsize)

    def _view(self, region: torch.Tensor, part: _Part) -> torch.Tensor:
        raw = region.view(torch.uint8)[part.start : part.start + part.nbytes]
        return raw.view(part.dtype).view(part.shape)

    def place(self, region: torch.Tensor, param: torch.Tensor) -> None:
        """Copy ``param``'s codes and quant state into ``region`` (its slice of the host buffer, at least
        ``nbytes`` long) and point them at it, so the store holds them once."""
        sources = _tensors_of(param)
        if [(o, n) for o, n, _ in sources] != [(p.owner, p.name) for p in self.parts]:
            raise ValueError("a 4-bit weight's quant state changed shape after the store read its layout")
        state = param.quant_state
        for (owner, name, tensor), part in zip(sources, self.parts):
            home = self._view(region, part)
            home.copy_(tensor)
            if name == "data":
                param.data = home
            else:
                setattr(state if not owner else getattr(state, owner), name, home)

    def view(self, region: torch.Tensor) -> torch.Tensor:
        """A ``Params4bit`` over ``region``'s bytes (a device slot's) with a quant state viewing them too."""
        from bitsandbytes.functional import QuantState
        from bitsandbytes.nn import Params4bit

        views = {(p.owner, p.name): self._view(region, p) for p in self.parts}
        nested = None
        if self.nested_blocksize is not None:
            nested = QuantState(absmax=views[("state2", "absmax")], code=views[("state2", "code")],
                                blocksize=self.nested_blocksize, dtype=self.nested_dtype)
        state = QuantState(absmax=views[("", "absmax")], shape=self.state_shape, code=views.get(("", "code")),
                           blocksize=self.blocksize, quant_type=self.quant_type, dtype=self.state_dtype,
                           offset=views.get(("", "offset")), state2=nested)
        return Params4bit(views[("", "data")], requires_grad=False, quant_state=state, blocksize=self.blocksize,
                          compress_statistics=self.compress_statistics, quant_type=self.quant_type,
                          quant_storage=self.quant_storage, bnb_quantized=True)


def packed_4bit_nbytes(numel: int, blocksize: int = 64, compress_statistics: bool = True) -> int:
    """Bytes :meth:`Packed4bit.of` lays out for a weight of ``numel`` elements that bitsandbytes' ``quantize_4bit``
    packs (uint8 storage): the codes, the absmax per block (8-bit with a nested fp32 absmax per 256 blocks and the
    nested 256-entry code and offset under ``compress_statistics``, else fp32), the 16-entry fp32 code. For the
    plan, which never quantizes."""
    blocks = -(-numel // blocksize)
    parts = [-(-numel // 2), blocks if compress_statistics else 4 * blocks, 16 * 4]
    if compress_statistics:
        parts += [4, 4 * -(-blocks // 256), 256 * 4]  # offset, nested absmax, nested code
    return sum(_aligned(n) for n in parts)
