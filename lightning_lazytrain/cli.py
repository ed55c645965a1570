"""The ``lazytrain`` console script: LightningCLI over `CausalLMModule` and `SFTDataModule`.

``lazytrain fit --config recipes/demo.yaml`` trains; ``validate``/``test``/``predict`` evaluate; ``--print_config``
shows the merged config. With a subcommand but no ``--config`` the demo recipe is used, so ``lazytrain fit`` alone
runs the CPU demo from a source checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

# Importing the package is what registers the "lazytrain" strategy names in Lightning's StrategyRegistry; it must
# happen before LightningCLI resolves `trainer.strategy`.
import lightning_lazytrain  # noqa: F401
from lightning_lazytrain.data.sft import SFTDataModule
from lightning_lazytrain.export import export_hf
from lightning_lazytrain.module import CausalLMModule

#: the recipe used when no --config is given (present in a source checkout; recipes/ sits at the repo root)
DEMO_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml"
_SUBCOMMANDS = ("fit", "validate", "test", "predict")


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
    """LightningCLI plus ``--export_dir`` (an HF directory of the trained model when ``fit`` ends) and
    ``--cpu_heap_cache`` (see :func:`keep_freed_memory_in_heap`)."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse's parser type
        parser.add_argument("--export_dir", type=str | None, default=None,
                            help="after fit, save the model + tokenizer here as an HF directory (safetensors)")
        parser.add_argument("--cpu_heap_cache", type=bool, default=True,
                            help="with trainer.accelerator=cpu, keep freed memory in the heap (faster CPU steps)")
        # one tokenizer setting for data and generation (and one value in the logged hparams of both)
        parser.link_arguments("data.tokenizer", "model.tokenizer")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if cfg.get("cpu_heap_cache") and cfg.get("trainer", {}).get("accelerator") == "cpu":
            keep_freed_memory_in_heap()

    def after_fit(self) -> None:
        export_dir = self.config[self.subcommand].get("export_dir")
        if export_dir and self.trainer.is_global_zero:
            export_hf(self.model.model, export_dir, tokenizer=self.model.tokenizer)


def _with_default_config(args: list[str]) -> list[str]:
    if args and args[0] in _SUBCOMMANDS and not any(a.startswith("--config") or a == "-c" for a in args):
        if DEMO_RECIPE.is_file():
            return [args[0], "--config", str(DEMO_RECIPE), *args[1:]]
    return args


def main(args: list[str] | None = None) -> LightningCLI:
    """Entry point of ``lazytrain``; ``args`` (without the program name) default to ``sys.argv[1:]``."""
    argv = _with_default_config(list(sys.argv[1:] if args is None else args))
    return LazyTrainCLI(
        CausalLMModule,
        SFTDataModule,
        args=argv,
        seed_everything_default=42,  # the paper's seed
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"parser_mode": "omegaconf"},
    )


if __name__ == "__main__":
    main()
