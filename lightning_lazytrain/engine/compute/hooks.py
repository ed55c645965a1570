"""The hooks on the user's HF model: instance-level ``forward`` overrides, removed again by ``remove()``.

Module names, parameters and ``state_dict`` stay exactly those of the user's model: nothing is wrapped. Decoder
layers only record their call; the final norm runs the recorded stack (one autograd Function); the embedding, norm
and head run on the device-resident copy. With labels, the causal-LM forward routes the loss through the chunked
head, so the batch x seq x vocab logits never exist.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from lightning_lazytrain.engine.compute.stack import LayerCall
from lightning_lazytrain.engine.loss.chunked import chunked_causal_lm_loss, chunked_token_accuracy
from lightning_lazytrain.engine.weights.binding import bound
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.models import ModelAdapter


@dataclass
class StreamedCausalLMOutput(CausalLMOutputWithPast):
    """The loss without logits (they never exist); in no-grad passes also the teacher-forced token accuracy."""

    token_accuracy: torch.Tensor | None = None


class HookedRunner(Protocol):
    """What the hooks call back into (the executor)."""

    adapter: ModelAdapter
    device: torch.device
    loss_chunk_bytes: int
    loss_kernel: bool | None
    resident_unit: ParamUnit

    def record(self, index: int, call: LayerCall) -> None: ...

    def run_stack(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def resident_tensors(self) -> list[torch.Tensor]: ...

    def head_weight(self) -> torch.Tensor: ...

    def wait_updates(self) -> None: ...

    def host_state_loaded(self, masters: bool) -> None: ...


class ModelHooks:
    """Installs the overrides and the device copies of the model's buffers; ``remove()`` gives the model back."""

    def __init__(self, runner: HookedRunner, resident_modules: list[nn.Module]) -> None:
        self.runner = runner
        model = runner.adapter.model
        self._saved_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._patched: list[tuple[nn.Module, bool]] = []
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.device != runner.device:
                    self._saved_buffers.append((module, name, buf))
                    module._buffers[name] = buf.to(runner.device)
        for j, layer in enumerate(runner.adapter.layers):
            self._patch(layer, types.MethodType(_recorder(runner, j), layer))
            if hasattr(layer, "gradient_checkpointing"):
                layer.gradient_checkpointing = False
        for module in resident_modules:
            fn = _norm_forward if module is runner.adapter.final_norm else _resident_forward
            self._patch(module, types.MethodType(_bind_resident(runner, fn), module))
        self.original_forward = types.MethodType(type(model).forward, model)
        self._patch(model, types.MethodType(_causal_lm_forward(runner, self.original_forward), model))
        # a state dict taken during the run (a user's callback) holds the weights after the step just taken: the
        # queued updates finish first, and device-resident masters are written back
        self._state_hooks = [
            model.register_state_dict_pre_hook(lambda *_: runner.wait_updates()),
            # a load during the run (the strategy's, or a callback's own load_state_dict) waits for the updates
            # still writing the masters, and the streamed copies and device homes are then refreshed from them
            model.register_load_state_dict_pre_hook(lambda *_: runner.wait_updates()),
            model.register_load_state_dict_post_hook(lambda *_: runner.host_state_loaded(masters=True)),
        ]

    def _patch(self, module: nn.Module, forward: Any) -> None:
        self._patched.append((module, "forward" in module.__dict__))
        module.forward = forward

    @contextlib.contextmanager
    def unhooked(self) -> Iterator[None]:
        """The layers' own forwards, for code that copies or runs a layer itself (the profiler)."""
        own = [(m, m.__dict__.pop("forward")) for m, _ in self._patched if "forward" in m.__dict__]
        try:
            yield
        finally:
            for module, forward in own:
                module.forward = forward

    def remove(self) -> None:
        """The model's own forwards again, and its buffers back on their old device."""
        for module, had_own in reversed(self._patched):
            if not had_own:
                del module.forward
        self._patched.clear()
        for module, name, buf in self._saved_buffers:
            module._buffers[name] = buf
        self._saved_buffers.clear()
        for hook in self._state_hooks:
            hook.remove()


def _recorder(runner: HookedRunner, j: int):
    def record(layer: nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        runner.record(j, LayerCall(args, kwargs))
        return hidden

    return record


def _bind_resident(runner: HookedRunner, fn):
    def forward(module: nn.Module, *args: Any, **kwargs: Any):
        return fn(runner, module, *args, **kwargs)

    return forward


def _resident_forward(runner: HookedRunner, module: nn.Module, *args: Any, **kwargs: Any):
    with bound(runner.resident_unit, runner.resident_tensors()):
        return type(module).forward(module, *args, **kwargs)


def _norm_forward(runner: HookedRunner, module: nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any):
    return _resident_forward(runner, module, runner.run_stack(hidden), *args, **kwargs)


def _on_device(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) and value.device != device else value


def _causal_lm_forward(runner: HookedRunner, original_forward: Any):
    def forward(model: nn.Module, input_ids=None, attention_mask=None, position_ids=None, *args: Any, **kwargs: Any):
        # The HF model's parameters live on the host, so ``model.device`` says CPU and ``generate`` builds some of
        # its inputs (cache positions, the next step's ids) there; the layers run on the executor's device.
        input_ids, attention_mask, position_ids = (_on_device(t, runner.device)
                                                   for t in (input_ids, attention_mask, position_ids))
        args = tuple(_on_device(a, runner.device) for a in args)
        kwargs = {k: _on_device(v, runner.device) for k, v in kwargs.items()}
        labels = kwargs.pop("labels", None)
        if labels is None:
            return original_forward(input_ids, attention_mask, position_ids, *args, **kwargs)
        if args:
            raise TypeError("with labels, pass the model's other inputs by keyword (input_ids=..., attention_mask=...)")
        for flag in ("output_hidden_states", "output_attentions"):
            if kwargs.pop(flag, False):
                raise ValueError(f"lazytrain streams the decoder layers and does not return {flag}")
        num_items = kwargs.pop("num_items_in_batch", None)
        for unused in ("use_cache", "cache", "past_key_values", "logits_to_keep", "return_dict"):
            kwargs.pop(unused, None)
        out = runner.adapter.decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
        )
        hidden, weight = out.last_hidden_state, runner.head_weight()
        loss = chunked_causal_lm_loss(hidden, weight, labels, num_items, runner.loss_chunk_bytes, runner.loss_kernel)
        accuracy = None
        if not torch.is_grad_enabled():
            accuracy = chunked_token_accuracy(hidden, weight, labels, runner.loss_chunk_bytes)
        return StreamedCausalLMOutput(loss=loss, logits=None, token_accuracy=accuracy)

    return forward
