"""Which HF model of a LightningModule the strategy streams: the one ``PreTrainedModel`` in it, or the one named."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel


class ModelNotFoundError(ValueError):
    """The LightningModule holds no ``PreTrainedModel``, several of them, or ``model_attr`` names something else."""


def find_hf_model(module: nn.Module, model_attr: str | None = None) -> PreTrainedModel:
    """``module.<model_attr>`` when given, else the one outermost ``PreTrainedModel`` among its submodules (a model
    nested inside another, as ``Qwen2ForCausalLM.model``, is part of the outer one)."""
    if model_attr is not None:
        model = getattr(module, model_attr, None)
        if not isinstance(model, PreTrainedModel):
            raise ModelNotFoundError(
                f"{type(module).__name__}.{model_attr} is {type(model).__name__}, not a transformers"
                " PreTrainedModel; point model_attr at the attribute holding the HF causal LM."
            )
        return model
    found = [(name, m) for name, m in module.named_modules() if isinstance(m, PreTrainedModel)]
    outer = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
    if not outer:
        raise ModelNotFoundError(
            f"{type(module).__name__} holds no transformers PreTrainedModel; lazytrain streams the layers of one"
            " HF causal LM (e.g. self.model = AutoModelForCausalLM.from_pretrained(...))."
        )
    if len(outer) > 1:
        names = ", ".join(n for n, _ in outer)
        raise ModelNotFoundError(
            f"{type(module).__name__} holds several PreTrainedModels ({names});"
            " say which one to stream with LazyTrainStrategy(model_attr=...)."
        )
    return outer[0][1]
