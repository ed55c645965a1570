"""``lazytrain plan``: will this config fit, and how fast will it step? Answered before any weight is loaded.

It reads the same config and overrides as ``lazytrain fit`` (``--config qwen2.5-7b --data.batch_size
64 --trainer.devices 2``), builds the model on the meta device, and runs admission and the activation plan for
the GPU here (measured profile), a named one (``--gpu h200``: published figures, analytic times) or, for a run
on the CPU, the CPU device (`plan_machine`). It prints host RAM, device memory and disk needed against what is
there, the plan, the predicted step time and TFLOPS, and the largest batch that fits.

Exit status: 0 with an answer (whether it fits is in it: "fits" / "DOES NOT FIT", ``"fits"`` in the JSON), 2 for
a usage or config error.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import warnings
from dataclasses import replace

import psutil

from lightning_lazytrain.models.adapter import UnsupportedModelError, adapter_for
from lightning_lazytrain.models.fused_kernels import fused_part_names
from lightning_lazytrain.optim.update_rate import host_update_rate
from lightning_lazytrain.schedule.batch_search import largest_batch
from lightning_lazytrain.schedule.disk import free_bytes
from lightning_lazytrain.schedule.forecast import Forecast, Machine, RunSpec, forecast
from lightning_lazytrain.schedule.gpus import GPUS
from lightning_lazytrain.sft.cli import ConfigError, LazyTrainCLI
from lightning_lazytrain.sft.data.errors import DataSettingError
from lightning_lazytrain.sft.data.sft import SFTDataModule
from lightning_lazytrain.sft.lora import LoraOptions, add_adapters
from lightning_lazytrain.sft.model_loading import check_sequence_length
from lightning_lazytrain.sft.module import CausalLMModule
from lightning_lazytrain.sft.plan_machine import cpu_machine, gpu_machine, plans_the_cpu
from lightning_lazytrain.sft.plan_model import meta_model, model_config
from lightning_lazytrain.sft.plan_report import render
from lightning_lazytrain.sft.plan_trainer import (
    checkpoint_dir,
    devices,
    kept_checkpoints,
    strategy_args,
    weights_only,
)
from lightning_lazytrain.units import GIB


class PlanCLI(LazyTrainCLI):
    """The fit parser plus the planner's own options; nothing is instantiated (the plan needs shapes only)."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse's parser type
        super().add_arguments_to_parser(parser)
        parser.add_argument(
            "--gpu", type=str | None, default=None, help=f"plan for this GPU instead of the one here: {', '.join(GPUS)}"
        )
        parser.add_argument(
            "--gpu_memory_gib",
            type=float | None,
            default=None,
            help="cap the GPU memory the plan may use (as the benchmarks' caps do)",
        )
        parser.add_argument(
            "--host_ram_gib",
            type=float | None,
            default=None,
            help="plan for a host with this much available RAM instead of this machine's",
        )
        parser.add_argument(
            "--disk_gib",
            type=float | None,
            default=None,
            help="plan for a checkpoint disk with this much free space instead of the checkpoint dir's",
        )
        parser.add_argument(
            "--update_gparams_per_s",
            type=float | None,
            default=None,
            help="the host's CPU optimizer update rate in G parameters/s (default: HybridAdamW's, measured here)",
        )
        parser.add_argument("--max_batch", type=bool, default=True, help="search for the largest batch that fits")
        parser.add_argument("--json", type=bool, default=False, help="print the answer as one JSON object")

    def before_instantiate_classes(self) -> None:
        """The data is not read: a plan needs its batch size and sequence length only."""

    def instantiate_classes(self) -> None:
        """Nothing is built here; `main` builds the model on the meta device."""


def _state_bytes(model: dict) -> float:
    """Optimizer state bytes per parameter for the recipe's optimizer."""
    name = str(model.get("optimizer") or "torch.optim.AdamW")
    if name.endswith("HybridAdamW"):
        fraction = float((model.get("optimizer_kwargs") or {}).get("eight_bit_fraction", 0.0))
        return 8.0 - 6.0 * fraction  # fp32 m and v, 8-bit ones for the fraction
    if name.endswith("SGD"):
        return 4.0 if (model.get("optimizer_kwargs") or {}).get("momentum") else 0.0
    return 8.0


def _update_rate(given: float | None, model: dict) -> tuple[float, str]:
    """(CPU update parameters/s, where it came from): ``--update_gparams_per_s``, else HybridAdamW's update timed
    on this host's kernel path with the recipe's 8-bit fraction (none for another optimizer), cached per host."""
    if given is not None:
        return float(given) * 1e9, "--update_gparams_per_s"
    name = str(model.get("optimizer") or "torch.optim.AdamW")
    fraction = float((model.get("optimizer_kwargs") or {}).get("eight_bit_fraction", 0.0))
    rate, path = host_update_rate(fraction if name.endswith("HybridAdamW") else 0.0)
    return rate, f"HybridAdamW measured here, kernel path {path}"


def _kernels(run: RunSpec) -> str:
    """Which kernels the streamed layers will run, in words."""
    if not run.kernels_fused:
        return "HF's own"
    names = fused_part_names(run.adapter.layers)
    if not names:
        return "HF's own (Liger's kernels cover no layer of this family)"
    return "Liger's fused " + (f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0])


def _plan(cli: PlanCLI) -> dict:
    cfg = cli.config.as_dict()
    model_cfg, data, trainer = cfg.get("model") or {}, cfg.get("data") or {}, cfg.get("trainer") or {}
    try:
        config, source = model_config(
            model_cfg.get("pretrained"), model_cfg.get("model_config"), bool(model_cfg.get("trust_remote_code"))
        )
        model = meta_model(config, bool(model_cfg.get("trust_remote_code")))
        lora = LoraOptions(**model_cfg["lora"]) if model_cfg.get("lora") else None
        if lora is not None:  # peft adapts the model in place; the 4-bit base is counted, never quantized, here
            add_adapters(model, replace(lora, quantize="none"))
        adapter = adapter_for(model)
    except (ValueError, OSError, UnsupportedModelError) as exc:
        raise ConfigError(f"the model cannot be planned: {exc}") from exc
    seq = int(data.get("max_seq_length") or 1024)
    try:
        check_sequence_length(config, seq, source)
    except DataSettingError as exc:
        raise ConfigError(str(exc)) from None
    strategy = strategy_args(trainer)
    world = devices(trainer) * int(trainer.get("num_nodes") or 1)
    known = set(RunSpec.__dataclass_fields__) - {
        "adapter",
        "seq",
        "precision",
        "optimizer_state_bytes_per_param",
        "grad_accumulation",
        "world_size",
        "ranks_per_host",
        "checkpoints_kept",
        "checkpoints_weights_only",
        "quantize",
    }
    run = RunSpec(
        adapter,
        seq,
        str(trainer.get("precision") or "32-true"),
        _state_bytes(model_cfg),
        int(trainer.get("accumulate_grad_batches") or 1) > 1,
        world,
        min(world, devices(trainer)),
        checkpoints_kept=kept_checkpoints(trainer),
        checkpoints_weights_only=weights_only(trainer),
        quantize=lora.quantize if lora is not None else "none",
        **{k: v for k, v in strategy.items() if k in known},
    )
    host = cfg.get("host_ram_gib")
    host_available = int(host * GIB) if host is not None else psutil.virtual_memory().available
    accelerator = trainer.get("accelerator")
    try:
        if plans_the_cpu(cfg.get("gpu"), accelerator):
            spec, profile_for, gpu_words = cpu_machine(run, host_available, accelerator)
        else:
            spec, profile_for, gpu_words = gpu_machine(cfg.get("gpu"), run)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.get("gpu_memory_gib") is not None:
        spec = replace(spec, memory_bytes=int(cfg["gpu_memory_gib"] * GIB))
        gpu_words += f", capped at {cfg['gpu_memory_gib']:g} GiB"
    disk_dir = run.spill_dir or "."
    update_rate, update_source = _update_rate(cfg.get("update_gparams_per_s"), model_cfg)
    machine = Machine(
        spec,
        host_available,
        shutil.disk_usage(disk_dir).free if run.spill_dir else 0,
        update_rate,
        int(cfg["disk_gib"] * GIB) if cfg.get("disk_gib") is not None else free_bytes(checkpoint_dir(trainer)),
    )
    batch = int(data.get("batch_size") or 1)
    asked = forecast(run, machine, batch, profile_for)
    search = cfg.get("max_batch", True)
    best: Forecast | None = largest_batch(run, machine, profile_for) if search else None
    answer = {
        "model": {
            "architecture": type(adapter.model).__name__,
            "config": source,
            "layers": adapter.num_layers,
            "params": run.trainable_params,
            "frozen_params": run.counts.frozen_params + run.counts.frozen_4bit_params,
            "quantize": run.quantize,
        },
        "gpu": {
            "name": spec.name,
            "description": spec.description,
            "memory_bytes": spec.memory_bytes,
            "bf16_tflops": spec.bf16_tflops,
            "source": gpu_words,
        },
        "host": {
            "available_bytes": machine.host_available_bytes,
            "source": "--host_ram_gib" if host is not None else "this machine",
            "update_params_per_s": machine.update_params_per_s,
            "update_source": update_source,
        },
        "run": {
            "seq": run.seq,
            "precision": run.precision,
            "world_size": run.world_size,
            "schedule": run.schedule,
            "optimizer_state_bytes_per_param": run.optimizer_state_bytes_per_param,
            "kernels": _kernels(run),
        },
        "asked": asked.to_dict(),
        "largest": None if best is None else best.to_dict(),  # None: not even batch 1, or not searched
        "largest_searched": bool(search),
    }
    return answer


def main(args: list[str]) -> int:
    """``lazytrain plan ...`` (``args`` without ``plan``); returns the exit status."""
    logging.getLogger("lightning.fabric.utilities.seed").setLevel(logging.WARNING)  # "Seed set to": no run here
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            cli = PlanCLI(
                CausalLMModule,
                SFTDataModule,
                args=args,
                run=False,
                save_config_callback=None,
                parser_kwargs={"parser_mode": "omegaconf", "prog": "lazytrain plan"},
            )
        answer = _plan(cli)
    except ConfigError as exc:
        print(f"lazytrain plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(answer, indent=2) if cli.config.get("json") else render(answer))
    return 0
