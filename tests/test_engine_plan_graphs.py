"""Per-layer kept graphs: the engine follows a plan's keep_graph list, the MILP decides it and honours
keep_graph_layers, and a plan file refuses keep_graph_layers (it carries its own list)."""

import json

import pytest
from helpers import batches, rel_diff, tiny_model, train

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.schedule import Schedule


def test_plan_file_keep_graph_pattern_trains_like_all_gpu(tmp_path):
    model, data = tiny_model("qwen2"), batches(3, padded=True)
    ref, _ = train(model, data, strategy=LazyTrainStrategy(schedule="interval:1"))
    plan = tmp_path / "plan.json"
    # layers 0 and 2 keep their graph, 1 and 3 re-run (3 inside a recompute-free block whose input is on the CPU)
    plan.write_text(
        Schedule(homes=["gpu", "gpu", "gpu", "cpu", "gpu"], keep_graph=[True, False, True, False]).to_json()
    )
    lt, trainer = train(model, data, strategy=LazyTrainStrategy(schedule=str(plan)))
    assert rel_diff(lt.model, ref.model) <= 1e-6


def test_milp_keeps_at_least_the_graphs_keep_graph_layers_asks_for(tmp_path):
    model, data = tiny_model("qwen3"), batches(3)
    ref, _ = train(model, data, strategy=LazyTrainStrategy(schedule="interval:1"))
    act = 2 * 16 * 64 * 4
    # room for the ends, two kept graphs (analytic bytes of the tiny layer) and little else
    strategy = LazyTrainStrategy(
        schedule="milp",
        keep_graph_layers=2,
        gpu_activation_gib=64 * act / 2**30,
        cpu_activation_gib=8 * act / 2**30,
        solver_time_limit=5.0,
    )
    lt, _ = train(model, data, strategy=strategy, default_root_dir=str(tmp_path))
    plan = json.loads((tmp_path / "lazytrain_plan.json").read_text())
    assert plan["keep_graph"][-2:] == [True, True]
    assert rel_diff(lt.model, ref.model) <= 1e-6


def test_milp_refuses_keep_graph_layers_whose_graphs_exceed_the_budget(tmp_path):
    act = 2 * 16 * 64 * 4
    strategy = LazyTrainStrategy(
        schedule="milp", keep_graph_layers=4, gpu_activation_gib=3 * act / 2**30, solver_time_limit=5.0
    )
    with pytest.raises(ValueError, match=r"keep_graph_layers \[0, 1, 2, 3\] need"):
        train(tiny_model("qwen3"), batches(1), strategy=strategy, max_steps=1, default_root_dir=str(tmp_path))


def test_keep_graph_layers_with_a_plan_file_is_refused(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(Schedule(homes=["gpu"] * 5).to_json())
    with pytest.raises(ValueError, match="keep_graph_layers=2 does not apply to the plan file"):
        train(
            tiny_model("qwen2"),
            batches(1),
            strategy=LazyTrainStrategy(schedule=str(plan), keep_graph_layers=2),
            max_steps=1,
        )


def test_a_reload_below_kept_graphs_starts_before_their_backward(tmp_path, monkeypatch):
    """Layers 2 and 3 keep their graphs; layer 1 re-runs from boundary 1, which lives on the CPU. Its reload must
    start while the head or the kept layers' backward can hide it, not at the re-run block's own ``get`` (before:
    only the next block's input was looked at, and a kept graph reads none back). Training matches all-GPU."""
    from lightning_lazytrain.engine.activations.homes import ActivationHomes
    from lightning_lazytrain.engine.grads.host import GradSink

    events: list[tuple[str, int]] = []
    prefetch, submit = ActivationHomes.prefetch, GradSink.submit

    def spy_prefetch(self, i):
        events.append(("reload", i))
        return prefetch(self, i)

    def spy_submit(self, unit, grads):
        events.append(("grads", unit.index))
        return submit(self, unit, grads)

    monkeypatch.setattr(ActivationHomes, "prefetch", spy_prefetch)
    monkeypatch.setattr(GradSink, "submit", spy_submit)
    model, data = tiny_model("qwen2"), batches(2)
    ref, _ = train(model, data, strategy=LazyTrainStrategy(schedule="interval:1"), max_steps=2)
    plan = tmp_path / "plan.json"
    homes, graphs = ["gpu", "cpu", "gpu", "gpu", "gpu"], [False, False, True, True]
    plan.write_text(Schedule(homes=homes, keep_graph=graphs).to_json())
    events.clear()
    lt, _ = train(model, data, strategy=LazyTrainStrategy(schedule=str(plan)), max_steps=2)
    assert rel_diff(lt.model, ref.model) <= 1e-6
    first_grads = next(k for k, e in enumerate(events) if e[0] == "grads")  # the top kept layer's backward
    assert ("reload", 1) in events[:first_grads], events[: first_grads + 3]
