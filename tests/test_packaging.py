"""The built wheel and sdist, offline with the environment's setuptools: the top-level ``recipes/`` is installed as
``lightning_lazytrain/recipes/`` (never as a top-level ``recipes`` package: torchtune's wheel ships one), every
module of the source tree is in the wheel, and an installed wheel finds the recipes by name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what a build reads from the checkout (pyproject.toml names the readme; the rest are packages and package data)
BUILD_INPUTS = ("pyproject.toml", "README.md", "lightning_lazytrain", "recipes")
#: the package data beside the modules: the demo data and the optimizer's C source
PACKAGE_DATA = ("py.typed", "*.jsonl", "*.c", "*.h")


def _copy_checkout(dest: Path) -> Path:
    """The build inputs copied to ``dest``, so the build's ``build/`` and ``*.egg-info`` stay out of the checkout."""
    dest.mkdir(exist_ok=True)
    for name in BUILD_INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, dest / name)
    return dest


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _build_wheel(source: Path, out: Path) -> Path:
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(source), cwd=source)
    (wheel,) = out.glob("lightning_lazytrain-*.whl")
    return wheel


def _wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {n for n in archive.namelist() if ".dist-info/" not in n}


def _recipe_files() -> set[str]:
    """The recipes' file names: the checkout's ``recipes/`` folder, which holds at least these three."""
    return {
        "demo.yaml",
        "qwen2.5-7b.yaml",
        "qwen2.5-72b-qlora.yaml",
        *(p.name for p in (ROOT / "recipes").glob("*.yaml")),
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = _copy_checkout(tmp_path_factory.mktemp("checkout"))
    return _build_wheel(source, tmp_path_factory.mktemp("wheel"))


def test_the_wheel_ships_the_recipes_inside_the_package(wheel):
    files = _wheel_files(wheel)
    assert {f"lightning_lazytrain/recipes/{n}" for n in _recipe_files()} <= files
    assert {f for f in files if f.endswith(".yaml")} == {f"lightning_lazytrain/recipes/{n}" for n in _recipe_files()}
    assert {f.split("/")[0] for f in files} == {"lightning_lazytrain"}  # no top-level recipes/ beside it


def test_the_wheel_holds_every_module_and_the_package_data(wheel):
    # pyproject.toml lists the packages by hand (the recipes' mapping needs it): a new package left out fails here
    files = _wheel_files(wheel)
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "lightning_lazytrain").rglob("*.py")}
    assert len(modules) > 100 and modules == {f for f in files if f.endswith(".py")}
    data = {str(p.relative_to(ROOT)) for g in PACKAGE_DATA for p in (ROOT / "lightning_lazytrain").rglob(g)}
    assert len(data) >= 4 and data <= files


def test_the_sdist_holds_the_recipes_and_builds_the_same_wheel(wheel, tmp_path):
    source = _copy_checkout(tmp_path / "checkout")
    build = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path / 'sdist')!r}))"
    proc = subprocess.run([sys.executable, "-c", build], cwd=source, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(tmp_path / "sdist" / proc.stdout.split()[-1]) as sdist:
        names = sdist.getnames()
        sdist.extractall(tmp_path / "unpacked", filter="data")
    (top,) = {n.split("/")[0] for n in names}
    assert {f"{top}/recipes/{n}" for n in _recipe_files()} <= set(names)
    rebuilt = _build_wheel(tmp_path / "unpacked" / top, tmp_path / "rebuilt")
    assert _wheel_files(rebuilt) == _wheel_files(wheel)


def test_an_installed_wheel_finds_the_recipes_by_name(wheel, tmp_path):
    site = tmp_path / "site"
    # --target ignores what the environment has installed (never --prefix: it uninstalls the editable install)
    _pip("install", "--no-deps", "--no-index", "--ignore-installed", "--target", str(site), str(wheel), cwd=tmp_path)
    probe = (
        "import lightning_lazytrain.sft.recipes as r; from lightning_lazytrain.sft.cli import DEMO_RECIPE;"
        "print(r.__file__); print(r.recipes_dir()); print(DEMO_RECIPE); print(' '.join(r.recipe_names()))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    module, folder, demo, names = proc.stdout.splitlines()[-4:]
    package = site / "lightning_lazytrain"
    assert Path(module) == package / "sft" / "recipes.py"  # the installed copy, not the checkout's
    assert Path(folder) == package / "recipes" and Path(demo) == package / "recipes" / "demo.yaml"
    assert names.split() == sorted(n.removesuffix(".yaml") for n in _recipe_files())
