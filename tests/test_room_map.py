"""docs/engine.md opens with the room map: every package and file of ``lightning_lazytrain``, one line each."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_lazytrain"
HEADING = "## The room map"


def _map_entries(text: str) -> list[tuple[str, str]]:
    """(path, what it is) per line of the fenced block under the room map's heading."""
    block = text.split(HEADING, 1)[1].split("```\n")[1]
    return [(path, what.strip()) for path, _, what in (line.partition(" ") for line in block.splitlines())]


def _tree() -> set[str]:
    """The package's files (``engine/plan.py``) and subpackages (``engine/``), as the map names them."""
    files = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    packages = {f"{p.parent.relative_to(PACKAGE)}/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    return files | packages


def test_the_map_reader_finds_each_path_and_its_line():
    text = f"# t\n\n{HEADING}\n\nwords\n\n```\nengine/                 the rooms\nengine/plan.py    one plan\n```\n"
    assert _map_entries(text) == [("engine/", "the rooms"), ("engine/plan.py", "one plan")]


def test_the_room_map_is_the_first_section_and_names_every_package_and_file_once():
    text = (ROOT / "docs" / "engine.md").read_text()
    assert text.split("\n## ", 1)[1].startswith(HEADING.removeprefix("## "))  # the doc opens with it
    entries = _map_entries(text)
    paths = [path for path, _ in entries]
    assert len(paths) == len(set(paths))
    assert {"engine/compute/stack.py", "node_load.py", "units.py", "sft/data/"} <= set(paths)
    assert set(paths) == _tree()
    assert all(what for _, what in entries)
