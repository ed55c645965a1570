"""The shipped recipes: LightningCLI YAML configs in the repository's top-level ``recipes/``, found by name.

The wheel installs that folder as ``lightning_lazytrain/recipes/`` (``package-dir`` in pyproject.toml; a top-level
``recipes`` would collide with torchtune's), so ``lazytrain fit --config qwen2.5-7b`` reads ``qwen2.5-7b.yaml``
without the repository; a ``--config`` that names an existing file is that file. ``lazytrain recipes``
lists them, each with the first paragraph of its leading comment.
"""

from __future__ import annotations

import difflib
import sys
from importlib.resources import files
from pathlib import Path

SUFFIX = ".yaml"


def recipes_dir() -> Path:
    """The folder of the shipped recipes: ``lightning_lazytrain/recipes/`` in an installed wheel (a real directory:
    setuptools installs package data unzipped), else the top-level ``recipes/`` of the source tree the package is
    imported from (an editable install, or the repository's root on the path)."""
    package = Path(str(files("lightning_lazytrain")))
    installed = package / "recipes"
    return installed if installed.is_dir() else package.parent / "recipes"


def recipe_names() -> list[str]:
    """The shipped recipes' names, sorted (``demo``, ``qwen2.5-7b``, ...)."""
    return sorted(p.name.removesuffix(SUFFIX) for p in recipes_dir().iterdir() if p.name.endswith(SUFFIX))


def recipe_path(name: str) -> Path | None:
    """The shipped recipe called ``name`` (with or without ``.yaml``), or None when there is none."""
    path = recipes_dir() / (name if name.endswith(SUFFIX) else name + SUFFIX)
    return path if "/" not in name and path.is_file() else None


def resolve_config(value: str) -> str:
    """A ``--config`` value as LightningCLI should read it: an existing file stays, a recipe name becomes its path."""
    if Path(value).exists():
        return value
    path = recipe_path(value)
    return str(path) if path is not None else value


def resolve_config_args(args: list[str]) -> list[str]:
    """``args`` with every ``--config``/``-c`` value that names a shipped recipe replaced by the recipe's path."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = resolve_config(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + resolve_config(arg.split("=", 1)[1])
    return out


def missing_recipe_hint(value: str) -> str | None:
    """For a ``--config`` value that is neither a file nor a shipped recipe, one line naming the recipes (the
    closest first) or, when its file name is a recipe, how to name it; None for a file or a YAML string."""
    if Path(value).exists() or recipe_path(value) is not None or any(c in value for c in ":{}\n"):
        return None  # jsonargparse reads a value with ':' or braces as the config's YAML text
    name = Path(value).name.removesuffix(SUFFIX)
    if recipe_path(name) is not None:
        return f"{value}: no such file; the shipped recipe '{name}' is run by name: --config {name}"
    names = recipe_names()
    closest = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    guess = f"did you mean --config {closest[0]}? " if closest else ""
    return f"--config {value}: no such file or shipped recipe; {guess}the shipped recipes: {', '.join(names)}"


def summary(name: str) -> str:
    """The first paragraph of the recipe's leading comment, as one line."""
    words: list[str] = []
    for line in (recipes_dir() / (name + SUFFIX)).read_text(encoding="utf-8").splitlines():
        text = line.removeprefix("#").strip()
        if not line.startswith("#") or not text:
            break
        words.append(text)
    return " ".join(words)


def main(args: list[str]) -> int:
    """``lazytrain recipes``: one line per shipped recipe; returns the exit status (2 for any argument)."""
    if args:
        print(f"lazytrain recipes: error: takes no arguments, got {' '.join(args)}", file=sys.stderr)
        return 2
    names = recipe_names()
    width = max(map(len, names))
    for name in names:
        print(f"{name:<{width}}  {summary(name)}")
    print(f"\nrun one with: lazytrain fit --config NAME  (the files are in {recipes_dir()})")
    return 0
