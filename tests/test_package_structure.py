"""The package's import graph: every module imports on its own, no two modules import each other (directly or
round a loop, type-only imports counted: they are coupling too), no two rooms (the package's subpackages and
top-level modules) either, and the library never imports the application; no source or test file is over
``MAX_LINES`` lines; the one Lightning strategy of the package holds its parts instead of inheriting them."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib

import pytest

import lightning_lazytrain

ROOT = pathlib.Path(lightning_lazytrain.__file__).parent
TESTS = pathlib.Path(__file__).parent
MAX_LINES = 300
LIBRARY = (
    "strategy",
    "precision",
    "parallel",
    "checkpointing",
    "resume",
    "run_engine",
    "planning",
    "admission",
    "tier_report",
    "faults",
    "engine",
    "schedule",
    "optim",
    "models",
    "checkpoint",
)


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ["lightning_lazytrain", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package modules ``name`` names in any import statement (top level, type-only or inside a function)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                named.add(sub if sub in modules else base)
    return {m for m in named if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_loop_of_three():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_the_package():
    modules = _modules()
    assert len(modules) > 80  # the walk found the package, subpackages included
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["lightning_lazytrain.engine.executor"] >= {"lightning_lazytrain.engine.compute.stack"}
    assert _cycles(graph) == []


def _room(module: str) -> str:
    """``lightning_lazytrain.engine.updates.cpu`` -> ``engine``; a top-level module is its own room."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for module, imported in graph.items():
        rooms.setdefault(_room(module), set()).update(_room(m) for m in imported)
    return {room: imported - {room} for room, imported in rooms.items()}


def test_the_room_graph_finds_a_cycle_between_packages():
    graph = {"p.engine.a": {"p.schedule.b"}, "p.schedule.b": set(), "p.schedule.c": {"p.engine.d"}, "p.engine.d": set()}
    assert _cycles(_room_graph(graph)) == [["engine", "schedule"]]
    assert _cycles(_room_graph({"p.engine.a": {"p.schedule.b"}, "p.schedule.b": set()})) == []


def test_no_import_cycle_between_the_rooms():
    """A room may import a module of another only where that one imports nothing of it back, at any depth: the
    engine runs plans and imports nothing of the planner; the planner reads the engine's figures."""
    modules = _modules()
    rooms = _room_graph({name: _imports(name, path, modules) for name, path in modules.items()})
    assert "schedule" in rooms["planning"] and "engine" in rooms["schedule"]
    assert "schedule" not in rooms["engine"] and "planning" not in rooms["engine"]
    assert _cycles(rooms) == []


# the engine's rooms and root modules in import order: each imports only those before it, so no loop can pass
ENGINE_ORDER = (
    "device",  # root: the streams and events (no-ops on the CPU)
    "link",  # root: the host-device link probe
    "plan",  # root: the one plan type
    "weights",  # weights in
    "activations",  # the boundaries' homes
    "loss",  # the chunked head loss
    "compute",  # the layers run: hooks, the stack Function, per-call overrides
    "grads",  # gradients out
    "updates",  # the per-unit updates
    "executor",  # root: the step's conductor
    "generation",  # evaluation-time generate, over the executor
)
ENGINE_ROOT = ("device", "link", "plan", "executor")


def _engine_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The engine's modules grouped by room (``p.engine.compute.stack`` -> ``compute``; a root module is its own),
    the package's ``__init__`` (which only re-exports) left out."""
    rooms: dict[str, set[str]] = {}
    for module, imported in graph.items():
        parts = module.split(".")
        if len(parts) > 2 and parts[1] == "engine":
            named = {m.split(".")[2] for m in imported if m.count(".") > 1 and m.split(".")[1] == "engine"}
            rooms.setdefault(parts[2], set()).update(named)
    return {room: imported - {room} for room, imported in rooms.items()}


def _against_the_order(rooms: dict[str, set[str]], order: tuple[str, ...]) -> list[tuple[str, str]]:
    """(room, imported room) for each import of a room that is not before it in ``order`` (unlisted rooms too)."""
    rank = {room: i for i, room in enumerate(order)}
    return sorted(
        (room, other)
        for room, imported in rooms.items()
        for other in imported
        if rank.get(other, len(order)) >= rank.get(room, -1)
    )


def test_the_order_check_finds_an_import_against_the_order():
    graph = {"p.engine.weights.a": {"p.engine.updates.b"}, "p.engine.updates.b": set(), "p.engine": {"p.engine.a"}}
    assert _engine_graph(graph) == {"weights": {"updates"}, "updates": set()}
    assert _against_the_order(_engine_graph(graph), ("weights", "updates")) == [("weights", "updates")]
    assert _against_the_order(_engine_graph(graph), ("updates", "weights")) == []
    assert _against_the_order({"a": {"b"}, "b": {"a"}}, ("a", "b")) == [("a", "b")]  # a loop breaks any order
    assert _against_the_order({"a": {"new"}}, ("a",)) == [("a", "new")]


def test_every_engine_module_is_in_a_room_or_a_root_module():
    """The engine's root holds only the root modules; every other module is in one of the rooms, each listed."""
    engine = ROOT / "engine"
    loose = {p.stem for p in engine.glob("*.py")} - {"__init__"}
    rooms = {p.parent.name for p in engine.glob("*/__init__.py")}
    assert loose == set(ENGINE_ROOT)
    assert rooms == set(ENGINE_ORDER) - set(ENGINE_ROOT)
    assert {p.parent for p in engine.rglob("*.py")} == {engine, *(engine / r for r in rooms)}  # no deeper floor


def test_the_engine_rooms_import_only_rooms_before_them():
    modules = _modules()
    rooms = _engine_graph({name: _imports(name, path, modules) for name, path in modules.items()})
    assert set(rooms) == set(ENGINE_ORDER)
    assert rooms["compute"] >= {"weights", "activations", "loss"} and "executor" in rooms["generation"]
    assert _against_the_order(rooms, ENGINE_ORDER) == []


def _long_files(paths: list[pathlib.Path]) -> dict[str, int]:
    lengths = {str(p): len(p.read_text().splitlines()) for p in paths}
    return {p: n for p, n in lengths.items() if n > MAX_LINES}


def test_no_file_is_over_the_line_limit(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    assert _long_files([long]) == {str(long): MAX_LINES + 1}
    files = [*ROOT.rglob("*.py"), *TESTS.rglob("*.py")]
    assert len(files) > 200  # the package and the tests
    assert _long_files(files) == {}


# modules that need a package only CUDA builds of torch bring; without it, the import must fail for that reason alone
NEEDS = {"lightning_lazytrain.optim.triton_adamw": "triton"}


def test_every_module_imports():
    for name in sorted(_modules()):
        needed = NEEDS.get(name)
        if needed is not None and importlib.util.find_spec(needed) is None:
            with pytest.raises(ModuleNotFoundError, match=needed):
                importlib.import_module(name)
        else:
            importlib.import_module(name)


def test_the_library_imports_nothing_from_the_application():
    modules = _modules()
    library = {n: p for n, p in modules.items() if n.count(".") and n.split(".")[1] in LIBRARY}
    assert {n.split(".")[1] for n in library} == set(LIBRARY)
    offenders = {
        n: sorted(m for m in _imports(n, p, modules) if m.startswith("lightning_lazytrain.sft"))
        for n, p in library.items()
    }
    assert {n: m for n, m in offenders.items() if m} == {}


def _package_strategies() -> list[type]:
    """The classes the package defines that are Lightning strategies."""
    from lightning.pytorch.strategies import Strategy

    found = []
    for name in sorted(_modules()):
        needed = NEEDS.get(name)
        if needed is not None and importlib.util.find_spec(needed) is None:
            continue
        module = importlib.import_module(name)
        found += [
            c for c in vars(module).values() if isinstance(c, type) and issubclass(c, Strategy) and c.__module__ == name
        ]
    return found


def test_the_strategy_is_one_class_with_no_strategy_chain():
    """``LazyTrainStrategy`` derives from Lightning's ``ParallelStrategy`` itself: no strategy class of ours
    between them (the process, checkpoint and engine parts are objects it holds), and no other anywhere."""
    from lightning.pytorch.strategies import ParallelStrategy

    from lightning_lazytrain import LazyTrainStrategy

    assert _package_strategies() == [LazyTrainStrategy]
    assert LazyTrainStrategy.__bases__ == (ParallelStrategy,)
    classes = [n for n in ast.walk(ast.parse((ROOT / "strategy.py").read_text())) if isinstance(n, ast.ClassDef)]
    assert [c.name for c in classes] == ["LazyTrainStrategy"]


def test_public_imports_keep_working():
    names = ("LazyTrainStrategy", "LazyTrainPrecision", "HybridAdamW", "CausalLMModule", "SFTDataModule")
    package = importlib.import_module("lightning_lazytrain")
    assert all(callable(getattr(package, n)) for n in names)
