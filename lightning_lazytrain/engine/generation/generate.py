"""Evaluation-time ``generate``: the layers resident for the evaluation, or streamed once per step for the batch.

The model's ``generate`` is replaced on the instance. Each call is planned by
:func:`lightning_lazytrain.engine.generation.plan.plan_generation`:

- **resident**: every decoder layer is copied once into one device buffer (kept until :meth:`release`, which the
  strategy calls when the evaluation ends and before the next training batch), the parameters point at it for the
  call and the engine's forward hooks are lifted, so it is plain HF ``generate`` with its usual KV cache;
- **streamed**: the engine's streamed forward, with the prompts split into the largest batches that fit, the KV
  cache on the device or in host memory (HF's offloaded cache).

Masters and ``state_dict`` are never touched: the device tensors stand in for the parameters only inside a call.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import psutil
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_lazytrain.engine.device import device_free_bytes
from lightning_lazytrain.engine.generation.plan import (
    GenerationMode,
    GenerationPlan,
    check_generation_mode,
    generation_costs,
    plan_generation,
)
from lightning_lazytrain.engine.weights.binding import bound
from lightning_lazytrain.engine.weights.layout import aligned_numel

if TYPE_CHECKING:
    from lightning_lazytrain.engine.executor import StreamingExecutor
    from lightning_lazytrain.engine.weights.layout import ParamUnit
    from lightning_lazytrain.engine.weights.versions import WeightVersions


class ResidentLayers:
    """Every decoder layer's streamed weights in one device buffer, refreshed when the masters changed."""

    def __init__(self, units: list[ParamUnit], versions: WeightVersions, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.units, self.versions = units, versions
        self.offsets = [0]
        for unit in units:
            self.offsets.append(self.offsets[-1] + aligned_numel(unit.numel, dtype.itemsize))
        with torch.inference_mode(False):  # an evaluation under inference mode creates it; later ones refresh it
            self.buffer = torch.empty(self.offsets[-1], dtype=dtype, device=device)
        self.generations = [-1] * len(units)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def refresh(self) -> None:
        """Copy the layers whose masters changed since the last copy (all of them the first time)."""
        with torch.inference_mode(False):
            for k, unit in enumerate(self.units):
                generation = self.versions.refresh(unit)  # waits for an update still running on a worker thread
                if self.generations[k] != generation:
                    start = self.offsets[k]
                    self.buffer[start : start + unit.numel].copy_(unit.stream, non_blocking=True)
                    self.generations[k] = generation

    def views(self, k: int) -> list[torch.Tensor]:
        start = self.offsets[k]
        return [e.view_in(self.buffer[start:]) for e in self.units[k].unique]


class EvalGeneration:
    """Owns the model's ``generate`` while the executor streams it. ``mode``: ``"auto"`` (admission decides),
    ``"resident"`` or ``"streamed"`` (forced)."""

    def __init__(self, executor: StreamingExecutor, mode: GenerationMode = "auto") -> None:
        check_generation_mode(mode)
        self.executor, self.mode = executor, mode
        self.resident: ResidentLayers | None = None
        self.last_plan: GenerationPlan | None = None
        self._announced: tuple | None = None
        model = executor.adapter.model
        self._model = model
        self._had_own = "generate" in model.__dict__
        self._generate = model.generate
        self._costs = generation_costs(model.config, executor.store.stream_dtype.itemsize)
        controller = self

        def generate(model: Any, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
            return controller.generate(inputs, **kwargs)

        model.generate = types.MethodType(generate, model)

    def close(self) -> None:
        self.release()
        if not self._had_own:
            del self._model.generate

    def release(self) -> None:
        """Drop the resident layer copies, so training finds the device memory it had before the evaluation."""
        if self.resident is None:
            return
        self.resident = None
        if self.executor.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def weights_bytes(self) -> int:
        item = self.executor.store.stream_dtype.itemsize
        return sum(u.numel for u in self.executor.layer_units) * item

    def plan(self, prompts: int, prompt_tokens: int, new_tokens: int) -> GenerationPlan:
        device = self.executor.device
        held = self.resident.nbytes if self.resident is not None else 0
        if device.type == "cuda":
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            free, host = device_free_bytes(device) + cached + held, psutil.virtual_memory().available
        else:
            free, host = psutil.virtual_memory().available + held, None
        return plan_generation(
            self._costs, prompts, prompt_tokens, new_tokens, self.weights_bytes, free, host, self.mode
        )

    def generate(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            return self._generate(inputs, **kwargs)  # inputs_embeds and other forms: one streamed call
        config = kwargs.get("generation_config") or self._model.generation_config
        new_tokens = kwargs.get("max_new_tokens") or config.max_new_tokens
        if new_tokens is None:
            new_tokens = max(1, (kwargs.get("max_length") or config.max_length or 20) - ids.shape[1])
        widen = max(1, kwargs.get("num_beams") or config.num_beams or 1)
        widen = max(widen, kwargs.get("num_return_sequences") or config.num_return_sequences or 1)
        plan = self.plan(ids.shape[0] * widen, ids.shape[1], new_tokens)
        plan = _per_prompt(plan, widen, ids.shape[0])
        self.last_plan = plan
        key = (plan.mode, plan.kv_on_device, plan.batches > 1)  # once per run, again only when the choice changes
        if key != self._announced:
            rank_zero_info(f"lazytrain generation: {plan.describe()}")
            self._announced = key
        if plan.mode == "streamed":
            self.release()
            if not plan.kv_on_device:
                kwargs.setdefault("cache_implementation", "offloaded")
            call = self._generate
        else:
            call = self._resident_generate
        if inputs is not None:
            kwargs["input_ids"] = inputs
        with warnings.catch_warnings():
            # HF compares the inputs' device with model.device, the host where lazytrain keeps the weights; the
            # layers run on the executor's device, where the inputs belong
            warnings.filterwarnings("ignore", message=_DEVICE_MISMATCH)
            if plan.batch_size >= ids.shape[0] or kwargs.get("return_dict_in_generate"):
                return call(**kwargs)
            return _in_batches(call, kwargs, ids.shape[0], plan.batch_size, _pad_id(kwargs, config))

    def _resident_generate(self, **kwargs: Any) -> Any:
        ex = self.executor
        if self.resident is None:
            self.resident = ResidentLayers(ex.layer_units, ex.store.versions, ex.device, ex.store.stream_dtype)
        self.resident.refresh()
        kwargs = {k: v.to(ex.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with self._bound_resident(), ex.unhooked():
            return self._generate(**kwargs)

    @contextlib.contextmanager
    def _bound_resident(self) -> Iterator[None]:
        ex, resident = self.executor, self.resident
        with contextlib.ExitStack() as stack:
            stack.enter_context(bound(ex.resident_unit, ex.resident_tensors()))
            for k, unit in enumerate(ex.layer_units):
                stack.enter_context(bound(unit, resident.views(k)))
            yield


_DEVICE_MISMATCH = r"You are calling \.generate\(\) with the `input_ids` being on a device type different"


def _per_prompt(plan: GenerationPlan, widen: int, prompts: int) -> GenerationPlan:
    """A plan made for ``prompts * widen`` sequences (beams, returned sequences), counted in prompts."""
    if widen == 1:
        return plan
    return GenerationPlan(
        plan.mode,
        prompts,
        max(1, plan.batch_size // widen),
        plan.kv_on_device,
        plan.weights_bytes,
        plan.kv_bytes,
        plan.activation_bytes,
        plan.device_free_bytes,
        plan.forced,
    )


def _pad_id(kwargs: dict[str, Any], config: Any) -> int:
    for value in (kwargs.get("pad_token_id"), config.pad_token_id, kwargs.get("eos_token_id"), config.eos_token_id):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def _in_batches(call: Any, kwargs: dict[str, Any], prompts: int, batch_size: int, pad_id: int) -> torch.Tensor:
    """``call`` over slices of the prompts (every tensor argument with a batch dimension is sliced); the outputs
    are right-padded with ``pad_id`` to the longest, as one ``generate`` over the whole batch pads them."""
    outputs = []
    for start in range(0, prompts, batch_size):
        part = {
            k: v[start : start + batch_size] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == prompts else v
            for k, v in kwargs.items()
        }
        outputs.append(call(**part))
    width = max(o.shape[1] for o in outputs)
    padded = [torch.nn.functional.pad(o, (0, width - o.shape[1]), value=pad_id) for o in outputs]
    return torch.cat([p.to(padded[0].device) for p in padded])
