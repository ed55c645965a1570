"""The ``lazytrain`` console script: LightningCLI over `CausalLMModule` and `SFTDataModule`.

``lazytrain fit --config demo`` trains; ``validate``/``test``/``predict`` evaluate; ``--print_config`` shows the
merged config. ``--config`` takes a file or the name of a shipped recipe (``lazytrain recipes`` lists them); with a
subcommand but no ``--config`` the demo recipe is used, so ``lazytrain fit`` alone runs the CPU demo. A model
source named on the command line replaces the config's other one (`with_one_model_source`). Commands of
our own beside LightningCLI's are dispatched from `COMMANDS`: ``plan`` says whether the config fits and how fast
it steps, loading nothing (`plan_command`); ``recipes`` lists the shipped recipes.

Exit status: 0 when the subcommand finished, 2 for a usage or config error, 1 when training (or evaluation) failed.
Bad input ends the process with a message, not a traceback: unknown keys and wrong types are refused by the config
parser, the data settings and path are checked before the model is built, an error while building the model,
datamodule or trainer from the config is reported as a config error, and a bad data file found at setup (a
``DataError``) too; a run refused at setup removes the log directory it made and left empty. A failure during the
run prints its traceback, then a one-line summary.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

import yaml
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.trainer import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from omegaconf.errors import OmegaConfBaseException

# Importing the package is what registers the "lazytrain" strategy names in Lightning's StrategyRegistry; it must
# happen before LightningCLI resolves `trainer.strategy`.
import lightning_lazytrain  # noqa: F401
from lightning_lazytrain.checkpoint.adapter_export import export_model
from lightning_lazytrain.checkpoint.hf_export import export_dtype
from lightning_lazytrain.engine.device import prefer_expandable_segments
from lightning_lazytrain.sft.data.errors import DataError, DataSettingError
from lightning_lazytrain.sft.data.settings import check_settings
from lightning_lazytrain.sft.data.sft import SFTDataModule
from lightning_lazytrain.sft.model_loading import check_positions_before_build
from lightning_lazytrain.sft.module import CausalLMModule
from lightning_lazytrain.sft.progress import MaxStepsProgressBar
from lightning_lazytrain.sft.recipes import missing_recipe_hint, recipe_path, resolve_config_args

#: the recipe used when no --config is given
DEMO_RECIPE = recipe_path("demo")
#: commands beside LightningCLI's: name -> ("module:function" called with the remaining args and returning the exit
#: status, whether it reads a --config like fit does); imported only when asked for (plan pulls in the MILP stack)
COMMANDS = {
    "plan": ("lightning_lazytrain.sft.plan_command:main", True),
    "recipes": ("lightning_lazytrain.sft.recipes:main", False),
}
_SUBCOMMANDS = ("fit", "validate", "test", "predict")
# the two ways of naming the model (`check_source`: exactly one of them)
_MODEL_SOURCES = ("--model.pretrained", "--model.model_config")
# config sections holding a class's arguments; the parser silently skips one that is a number, bool or list
_GROUPS = ("model", "data", "trainer")


class ConfigError(ValueError):
    """The config names something that cannot be built (the model, the datamodule or the trainer)."""


def keep_freed_memory_in_heap() -> bool:
    """Make glibc keep freed blocks in the heap instead of unmapping them (CPU runs only).

    A CPU step allocates and frees the B x T x vocab logits (hundreds of MB) several times; by default glibc maps
    and unmaps such blocks each time, and the page faults on re-touching them cost ~40% of the demo's step time.
    Turning off mmap for large blocks and never trimming keeps them mapped. Not for GPU runs: a streaming strategy
    wants host memory it frees to go back to the OS. Returns whether it could be applied (glibc only).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_max = -1, -4  # glibc's mallopt parameter numbers
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):
        return False


class LazyTrainCLI(LightningCLI):
    """LightningCLI plus ``--export_dir`` (an HF directory of the trained model when ``fit`` ends, its weights in
    ``--export_dtype``) and ``--cpu_heap_cache`` (see :func:`keep_freed_memory_in_heap`)."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse's parser type
        parser.add_argument("--export_dir", type=str | None, default=None,
                            help="after fit, save the model + tokenizer here as an HF directory (safetensors)")
        parser.add_argument("--export_merged_dir", type=str | None, default=None,
                            help="LoRA: also write the merged model (adapters folded into the base) here")
        parser.add_argument("--export_dtype", type=str | None, default="bfloat16",
                            help="dtype of the exported weights (bfloat16, float16, float32; null: as trained)")
        parser.add_argument("--cpu_heap_cache", type=bool, default=True,
                            help="with trainer.accelerator=cpu, keep freed memory in the heap (faster CPU steps)")
        # one tokenizer setting for data and generation (and one value in the logged hparams of both)
        parser.link_arguments("data.tokenizer", "model.tokenizer")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        # the model is built next (minutes for a large checkpoint): learn about a wrong data path or setting first
        try:
            check_settings(cfg.get("data") or {}, check_path=True)
        except DataSettingError as exc:  # name the key as the config spells it
            raise DataSettingError(f"data.{exc.field}", exc.problem, exc.fix) from None
        seq = (cfg.get("data") or {}).get("max_seq_length")
        if isinstance(seq, int):
            check_positions_before_build(cfg.get("model") or {}, seq)
        _check_logger_installed((cfg.get("trainer") or {}).get("logger"))
        try:
            export_dtype(cfg.get("export_dtype"))
        except ValueError as exc:
            raise ConfigError(f"--export_dtype: {exc}") from None
        if cfg.get("cpu_heap_cache") and cfg.get("trainer", {}).get("accelerator") == "cpu":
            keep_freed_memory_in_heap()

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except DataError:
            raise
        except (ValueError, TypeError, KeyError, OSError, ImportError, MisconfigurationException) as exc:
            raise ConfigError(f"the config cannot be built: {type(exc).__name__}: {exc}") from exc

    def instantiate_trainer(self, **kwargs: object) -> Trainer:
        config = self.config_init[self.subcommand]["trainer"] if self.subcommand else self.config_init["trainer"]
        callbacks = list(config.get("callbacks") or [])
        # Lightning adds its own bar when the callbacks have none; give it ours (the same bar, a right epoch total)
        wants_bar = config.get("enable_progress_bar") is not False
        if _RICH_AVAILABLE and wants_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs.setdefault("callbacks", [*callbacks, MaxStepsProgressBar()])
        return super().instantiate_trainer(**kwargs)

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            # a run refused at setup (bad data) made its logger's directory and wrote nothing into it: no trace of
            # the refused run is kept (a directory with a file in it stays)
            remove_empty_log_dirs(self.trainer)
            raise

    def after_fit(self) -> None:
        config = self.config[self.subcommand]
        if config.get("export_dir") and self.trainer.is_global_zero:
            export_model(self.model.model, config["export_dir"], tokenizer=self.model.tokenizer,
                         dtype=config.get("export_dtype"), merged_dir=config.get("export_merged_dir"))


def remove_empty_log_dirs(trainer: Trainer) -> None:
    """Remove each logger's run directory (``lightning_logs/version_N``) that exists and holds nothing, and then
    ``lightning_logs`` too if that leaves it empty."""
    for logger in trainer.loggers:
        path = getattr(logger, "log_dir", None)
        for folder in (path, os.path.dirname(path)) if path else ():
            with contextlib.suppress(OSError):  # another process wrote there meanwhile: keep it
                if os.path.isdir(folder) and not os.listdir(folder):
                    os.rmdir(folder)


def _check_logger_installed(logger: object) -> None:
    """A TensorBoardLogger without ``tensorboard`` (or ``tensorboardX``) installed: one line naming the extra,
    instead of the parser's every-Union-member account of why it cannot build the logger."""
    from lightning.fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE

    loggers = logger if isinstance(logger, list) else [logger]
    names = [str(lg.get("class_path", "")) for lg in loggers if hasattr(lg, "get")]
    if any(n.endswith("TensorBoardLogger") for n in names) and not (_TENSORBOARD_AVAILABLE or _TENSORBOARDX_AVAILABLE):
        raise ConfigError("trainer.logger is a TensorBoardLogger, which needs the tensorboard package: pip install"
                          " 'lightning-lazytrain[tensorboard]' (or tensorboard / tensorboardX), or keep the CSVLogger")


def _with_default_config(args: list[str]) -> list[str]:
    takes_config = (*_SUBCOMMANDS, *(name for name, (_, config) in COMMANDS.items() if config))
    if args and args[0] in takes_config and not any(a.startswith("--config") or a == "-c" for a in args):
        return [args[0], "--config", str(DEMO_RECIPE), *args[1:]]
    return args


def with_one_model_source(args: list[str]) -> list[str]:
    """``args`` where a model source named on the command line replaces the config's other one.

    ``--model.pretrained DIR`` on a random-init recipe (the demo) means that model, not the recipe's shape, and
    ``--model.model_config NAME`` on a recipe of weights a random-init run: the other source becomes null right
    after it (a later ``--config`` can still set it). Both named (not null) stays the module's error.
    """
    named: dict[str, tuple[int, str]] = {}  # flag -> (index of the last argument it takes, its value)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in _MODEL_SOURCES and eq:
            named[flag] = (i, value)
        elif arg in _MODEL_SOURCES and i + 1 < len(args):
            named[arg] = (i + 1, args[i + 1])
    if len(named) != 1:
        return args
    ((flag, (last, value)),) = named.items()
    if value.strip().lower() in ("null", "none"):
        return args
    (other,) = (f for f in _MODEL_SOURCES if f != flag)
    return [*args[: last + 1], other, "null", *args[last + 1 :]]


def _config_paths(args: list[str]) -> Iterator[str]:
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            yield args[i + 1]
        elif arg.startswith("--config="):
            yield arg.split("=", 1)[1]


def config_problem(args: list[str]) -> str | None:
    """What is wrong with a ``--config`` file that the parser would ignore or report without naming the file."""
    for path in _config_paths(args):
        hint = missing_recipe_hint(path)
        if hint:
            return hint
        try:
            cfg = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # the parser reports these itself, naming the file and the line
        if cfg is None:
            return f"{path}: the config file is empty; give it at least one section (model, data, trainer)"
        if not isinstance(cfg, dict):
            return f"{path}: a config file is a mapping of sections (model, data, trainer), got a {type(cfg).__name__}"
        for group in _GROUPS:
            value = cfg.get(group)
            if value is not None and not isinstance(value, (dict, str)):
                return (f"{path}: '{group}' must be a mapping of its settings (or a path to a config file), got "
                        f"{type(value).__name__} {value!r}")
    return None


def _fail(message: str) -> int:
    print(f"lazytrain: error: {message}", file=sys.stderr)
    return 2


def _run_failed(exc: BaseException) -> int:
    traceback.print_exception(exc)
    summary = str(exc).strip().splitlines()
    print(f"lazytrain: error: the run failed: {type(exc).__name__}" + (f": {summary[0]}" if summary else ""),
          file=sys.stderr)
    return 1


def main(args: list[str] | None = None) -> int:
    """Entry point of ``lazytrain``; ``args`` (without the program name) default to ``sys.argv[1:]``.

    Returns the exit status: 0 done, 1 the run failed, 2 a usage or config error. The parser's own errors and
    ``--help``/``--print_config`` end the process by ``SystemExit`` with its status (2, or 0).
    """
    argv = _with_default_config(resolve_config_args(list(sys.argv[1:] if args is None else args)))
    argv = with_one_model_source(argv)
    prefer_expandable_segments()  # read when CUDA's caching allocator starts: before anything touches the GPU
    problem = config_problem(argv)
    if problem:
        return _fail(problem)
    if argv[:1] and argv[0] in COMMANDS:
        module, function = COMMANDS[argv[0]][0].split(":")
        return getattr(importlib.import_module(module), function)(argv[1:])
    with warnings.catch_warnings():
        # we pass sys.argv on as `args` (to insert the demo config), which LightningCLI warns about as a mistake
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        try:
            LazyTrainCLI(
                CausalLMModule,
                SFTDataModule,
                args=argv,
                seed_everything_default=42,  # the paper's seed
                save_config_kwargs={"overwrite": True},
                parser_kwargs={"parser_mode": "omegaconf"},
            )
        except (DataError, ConfigError, MisconfigurationException) as exc:
            return _fail(str(exc))
        except OmegaConfBaseException as exc:  # e.g. an ${interpolation} of a key that does not exist
            return _fail(f"in the config: {exc}".strip())
        except Exception as exc:  # any other failure is the run's: exit 1 after its traceback
            return _run_failed(exc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
