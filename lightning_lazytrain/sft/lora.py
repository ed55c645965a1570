"""The SFT module's ``lora:`` block: LoRA adapters over a frozen base, built with peft's own ``LoraConfig``.

``CausalLMModule(lora=LoraOptions(r=16))`` (in a recipe ``model.lora.r: 16``, on the command line
``--model.lora.r 16``) wraps the built model with ``peft.get_peft_model``; everything but the adapters is then
frozen, and lazytrain holds that base once, as its streamed copy, and saves only the adapters in checkpoints.
``quantize: nf4`` (or ``fp4``) is QLoRA: the module builds the model layer by layer with its decoder layers' linear
layers quantized by bitsandbytes to 4 bits (``model_loading.build_quantized_model``) before the adapters are
added, and lazytrain holds and streams them in that packed form. ``build_device`` says where each layer is
materialised and quantized before its packed form goes to the host (`layer_build_device`): on the GPU it takes
seconds a layer, on the CPU about a minute at the Qwen2.5-72B shape.
peft and bitsandbytes are the ``lora`` extra (``pip install lightning-lazytrain[lora]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import nn

from lightning_lazytrain.models.quantize import QUANT_TYPES

#: the linear layers of a Qwen/Llama decoder layer (attention and MLP projections)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: where the layer-by-layer 4-bit build materialises and quantizes each decoder layer
BuildDevice = Literal["auto", "cpu", "cuda"]


@dataclass
class LoraOptions:
    """LoRA settings (peft's ``LoraConfig`` names): rank ``r``, scale ``alpha / r``, dropout on the adapter input,
    the module names adapted. ``quantize``: the decoder layers' base weights, ``none`` as the model is built
    (``model.dtype``), ``nf4``/``fp4`` (QLoRA) as bitsandbytes' 4-bit codes, dequantized to ``model.dtype`` to
    compute. ``build_device``: where a 4-bit base's layers are materialised and quantized before they are held on
    the host (`layer_build_device`): ``auto`` the run's GPU (outside a Trainer: the GPU when CUDA is available),
    else the CPU; ``cpu``; ``cuda``."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(ALL_LINEAR))
    quantize: Literal["none", "nf4", "fp4"] = "none"
    build_device: BuildDevice = "auto"


def check_lora(options: LoraOptions) -> None:
    """Refuse settings that cannot work, naming what to change (at module construction, before any loading)."""
    if options.r < 1:
        raise ValueError(f"lora.r must be at least 1, got {options.r}")
    if not 0.0 <= options.dropout < 1.0:
        raise ValueError(f"lora.dropout must be in [0, 1), got {options.dropout}")
    if not options.target_modules:
        raise ValueError(f"lora.target_modules is empty: name the linear layers to adapt, e.g. {ALL_LINEAR}")
    if options.quantize not in ("none", *QUANT_TYPES):
        raise ValueError(f"lora.quantize must be none, nf4 or fp4, got {options.quantize!r}")
    _check_build_device(options)
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        raise ImportError("model.lora needs peft: pip install 'lightning-lazytrain[lora]'") from exc
    if options.quantize != "none":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            raise ImportError(f"lora.quantize: {options.quantize} needs bitsandbytes: pip install"
                              " 'lightning-lazytrain[lora]', or use lora.quantize: none") from exc


def _check_build_device(options: LoraOptions) -> None:
    if options.build_device not in get_args(BuildDevice):
        raise ValueError(f"lora.build_device must be auto, cpu or cuda, got {options.build_device!r}")
    if options.build_device != "cuda":
        return
    if options.quantize == "none":
        raise ValueError("lora.build_device: cuda builds a 4-bit base on the GPU, but lora.quantize is none (the model"
                         " is loaded whole on the host): set lora.quantize to nf4 or fp4, or lora.build_device to auto"
                         " or cpu")
    if not torch.cuda.is_available():
        raise ValueError("lora.build_device is cuda but CUDA is not available here: set lora.build_device to auto or"
                         " cpu (--model.lora.build_device cpu) to quantize the layers on the CPU (about a minute a"
                         " layer at the 72B shape), or run on a machine with a GPU")


def layer_build_device(options: LoraOptions, run_device: torch.device | None) -> torch.device:
    """Where the 4-bit build materialises and quantizes each layer. ``run_device``: the device the Trainer's
    strategy runs on (None outside a Trainer). ``cuda`` and ``auto`` on a GPU run use that GPU; ``auto`` builds on
    the CPU when the run is on the CPU (so a CPU run never touches a GPU it was not given) and, outside a Trainer,
    on the GPU when CUDA is available."""
    on_gpu = run_device is not None and run_device.type == "cuda"
    if options.build_device == "cpu" or (options.build_device == "auto" and run_device is not None and not on_gpu):
        return torch.device("cpu")
    if on_gpu:
        return run_device
    if options.build_device == "cuda" or torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def add_adapters(model: nn.Module, options: LoraOptions) -> nn.Module:
    """``model`` wrapped by peft with LoRA on ``options.target_modules``; its other parameters frozen (a 4-bit
    base is built so beforehand: ``model_loading.build_quantized_model``)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=options.r, lora_alpha=options.alpha, lora_dropout=options.dropout,
                        target_modules=list(options.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)
