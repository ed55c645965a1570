"""HybridAdamW: AdamW with fp32 moments for some tensors and blockwise 8-bit moments for the rest.

Which tensors get 8-bit moments: ``state_layout.py``. Saved states carry their own layout: a checkpoint restores
exactly what it holds, whatever the rule says.

CPU tensors go through the fused C kernel (``kernel.py``); other devices, and ``use_kernel=False``, through the
torch reference (``reference.py``). Masters may be fp32 or bf16 (bf16: the update is computed in fp32 and written
back with deterministic stochastic rounding); gradients may be fp32 or bf16.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.optim import Optimizer

from . import kernel as _kernel
from .reference import mix32, reference_step, v_floor_coef
from .state_layout import STATE_TENSORS, choose_8bit, defer_state_allocation, init_state

__all__ = ["HybridAdamW", "defer_state_allocation"]

_FP32_CHUNK = 4096  # elements per kernel work item for fp32-state tensors (fits L1/L2 with its scratch)


class HybridAdamW(Optimizer):
    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        eight_bit_fraction: float = 0.0,
        block_size: int = 4096,
        min_8bit_numel: int = 4096,
        *,
        seed: int = 0,
        use_kernel: bool | None = None,
        num_threads: int | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"invalid lr/eps/weight_decay: {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}")
        if not 0.0 <= eight_bit_fraction <= 1.0:
            raise ValueError(f"eight_bit_fraction must be in [0, 1], got {eight_bit_fraction}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.eight_bit_fraction = eight_bit_fraction
        self.block_size = block_size
        self.min_8bit_numel = min_8bit_numel
        self.seed = seed
        self.num_threads = num_threads
        self._stream_copies: dict[torch.Tensor, torch.Tensor] = {}
        all_params = [p for g in self.param_groups for p in g["params"]]
        for p in all_params:
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"HybridAdamW supports fp32 and bf16 parameters, got {p.dtype}")
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        chosen = self._choose_8bit(all_params)
        for i, p in enumerate(all_params):
            self._init_state(p, i, eight_bit=i in chosen)
        wants_kernel = any(p.device.type == "cpu" for p in all_params)
        self._use_kernel = False
        if use_kernel or (use_kernel is None and wants_kernel):
            try:
                _kernel.load_kernel()  # build now, at construction, never in the middle of a step
                self._use_kernel = True
            except _kernel.KernelUnavailable as e:
                if use_kernel:
                    raise
                warnings.warn(f"HybridAdamW falls back to the slow torch path on the CPU: {e}", stacklevel=2)

    def _choose_8bit(self, params: list[torch.Tensor]) -> set[int]:
        return choose_8bit(params, self.eight_bit_fraction, self.min_8bit_numel)

    def _init_state(self, p: torch.Tensor, index: int, eight_bit: bool) -> None:
        init_state(self.state[p], p, index, eight_bit, self.block_size, self.seed)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if not hasattr(self, "_group_of"):  # called from Optimizer.__init__; layout is set up after
            return
        group = self.param_groups[-1]
        base = sum(len(g["params"]) for g in self.param_groups[:-1])
        chosen = self._choose_8bit(group["params"])
        for j, p in enumerate(group["params"]):
            self._group_of[p] = group
            self._init_state(p, base + j, eight_bit=j in chosen)

    @property
    def kernel_path(self) -> str:
        """The update path of CPU tensors: the fused kernel's (``c/avx512vbmi``, ``c/avx512f``, ``c/scalar``)
        or ``torch`` (the reference path: no kernel, or ``use_kernel=False``)."""
        return _kernel.kernel_path() if self._use_kernel else "torch"

    def is_8bit(self, p: torch.Tensor) -> bool:
        return "exp_avg_codes" in self.state[p]

    def state_tensors(self, p: torch.Tensor) -> list[torch.Tensor]:
        """The moment tensors of ``p`` (fp32 moments, or 8-bit codes and their block absmax)."""
        st = self.state.get(p, {})
        return [st[k] for k in STATE_TENSORS if k in st]

    def state_bytes(self) -> int:
        """Bytes held by the moment tensors (what 8-bit states shrink), excluding parameters and grads."""
        return sum(t.numel() * t.element_size() for p in self.state for t in self.state_tensors(p))

    def register_stream_copy(self, param: torch.Tensor, copy: torch.Tensor | None) -> None:
        """Have every update of ``param`` also write ``copy`` (bf16, same shape; the tensor the engine streams).

        ``None`` unregisters. The copy is not part of the state dict (it is derived from the parameter).
        """
        if copy is None:
            self._stream_copies.pop(param, None)
            return
        if param not in self._group_of:
            raise KeyError("register_stream_copy: parameter is not managed by this optimizer")
        if copy.dtype != torch.bfloat16 or copy.shape != param.shape or copy.device != param.device:
            raise ValueError(
                f"stream copy must be bf16 {tuple(param.shape)} on {param.device}, got {copy.dtype} "
                f"{tuple(copy.shape)} on {copy.device}"
            )
        if not copy.is_contiguous():
            raise ValueError("stream copy must be contiguous")
        self._stream_copies[param] = copy

    # ----------------------------------------------------------------- update
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every parameter that has a ``.grad``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_params([p for g in self.param_groups for p in g["params"] if p.grad is not None])
        return loss

    @torch.no_grad()
    def step_params(
        self,
        params: Sequence[torch.Tensor],
        clip_coef: float = 1.0,
        grads: Sequence[torch.Tensor | None] | None = None,
        lr_of: dict[int, float] | None = None,
    ) -> None:
        """Update only ``params``: gradient = ``grads[i]`` (or ``p.grad``) x ``clip_coef``, fused into the pass.

        ``lr_of`` maps ``id(param_group)`` to the learning rate to use, for updates that run after a scheduler may
        already have moved the group's ``lr`` on (the engine snapshots it when it schedules the update).

        Safe to call from a worker thread (the kernel runs without the GIL) and concurrently for disjoint
        parameter lists. Gradients may be bf16 for fp32 parameters. Parameters without a gradient are skipped.
        """
        if grads is not None and len(grads) != len(params):
            raise ValueError(f"step_params: {len(params)} params but {len(grads)} grads")
        clip_coef = float(clip_coef)
        for i, p in enumerate(params):
            g = p.grad if grads is None else grads[i]
            if g is None:
                continue
            self._update_one(p, g, clip_coef, lr_of)

    def _prepare(
        self, p: torch.Tensor, g: torch.Tensor, clip_coef: float, lr_of: dict[int, float] | None
    ) -> tuple[dict, dict]:
        """Check the pair, count the step and return (state, the update's scalars) as the kernel takes them."""
        group = self._group_of.get(p)
        if group is None:
            raise KeyError("step_params: parameter is not managed by this optimizer")
        if g.shape != p.shape:
            raise ValueError(f"gradient shape {tuple(g.shape)} != parameter shape {tuple(p.shape)}")
        if g.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"gradients must be fp32 or bf16, got {g.dtype}")
        st = self.state[p]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if lr_of is not None:
            lr = lr_of.get(id(group), lr)
        st["step"] += 1
        step = st["step"]
        # Scalars exactly as torch.optim.AdamW computes them (Python doubles, rounded to fp32 by the kernel).
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        sr_key = int(mix32(st["sr_key"] ^ int(mix32(step & 0xFFFFFFFF))))
        eight_bit = "exp_avg_codes" in st
        block = st["block_size"] if eight_bit else _FP32_CHUNK
        return st, dict(
            copy=self._stream_copies.get(p),
            block=block,
            decay=1 - lr * wd,
            beta1=beta1,
            beta2=beta2,
            neg_step=-(lr / bias_correction1),
            bc2_sqrt=bias_correction2**0.5,
            eps=eps,
            grad_scale=clip_coef,
            sr_key=sr_key,
            v_floor=v_floor_coef(beta1, beta2, step) if eight_bit else 0.0,
        )

    def _update_one(self, p: torch.Tensor, g: torch.Tensor, clip_coef: float, lr_of: dict[int, float] | None) -> None:
        st, scalars = self._prepare(p, g, clip_coef, lr_of)
        if self._use_kernel and p.device.type == "cpu" and p.is_contiguous():
            if g.device.type != "cpu":
                raise ValueError("a CPU parameter needs a CPU gradient")
            _kernel.run_step(
                param=p,
                grad=g.contiguous(),
                m=st.get("exp_avg"),
                v=st.get("exp_avg_sq"),
                mq=st.get("exp_avg_codes"),
                vq=st.get("exp_avg_sq_codes"),
                mabs=st.get("exp_avg_absmax"),
                vabs=st.get("exp_avg_sq_absmax"),
                nthreads=self.num_threads or torch.get_num_threads(),
                **scalars,
            )
        else:
            reference_step(param=p, grad=g.to(p.device), state=st, **scalars)

    def prepare_update(
        self, p: torch.Tensor, g: torch.Tensor, clip_coef: float, lr_of: dict[int, float] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """Count a step of ``p`` and return what one update of it reads and writes besides ``p`` and ``g``: its
        state tensors by name, and the update's scalars as ``optim.reference.reference_step`` takes them
        (``copy``: the registered stream copy, or None).

        For an engine that runs the update elsewhere (``engine/updates/device.py``: on the GPU, from copies of
        these tensors, written back afterwards); ``step_params`` is this followed by the update on the CPU.
        """
        st, scalars = self._prepare(p, g, float(clip_coef), lr_of)
        return {k: st[k] for k in STATE_TENSORS if k in st}, scalars

    # ----------------------------------------------------------------- checkpoint
    def load_state_dict(self, state_dict: dict) -> None:
        """Exact restore: states keep their saved dtypes (torch's default would cast fp32/absmax to bf16 params)."""
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) != len(saved_groups) or any(
            len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups, strict=True)
        ):
            raise ValueError("loaded state dict does not match this optimizer's parameter groups")
        id_map = {}
        for g, s in zip(groups, saved_groups, strict=True):
            id_map.update(zip(s["params"], g["params"], strict=True))
        for g, s in zip(groups, saved_groups, strict=True):
            g.update({k: v for k, v in s.items() if k != "params"})
        new_state = {}
        for old_id, saved in state_dict["state"].items():
            p = id_map[old_id]
            restored = {}
            for k, v in saved.items():
                if isinstance(v, torch.Tensor):
                    restored[k] = v.detach().to(device=p.device, copy=True)  # keep dtype; never alias the dict
                else:
                    restored[k] = v
            new_state[p] = restored
        for p in id_map.values():
            self.state[p] = new_state.get(p, self.state[p])

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}
