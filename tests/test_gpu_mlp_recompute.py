"""The MLP re-run choice on a CUDA device: streamed weights in slots, autocast, the measured profile."""

import pytest
import torch
from helpers import batches, rel_diff, tiny_model, train, update_rel_diff

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.models import adapter_for
from lightning_lazytrain.schedule import Schedule
from lightning_lazytrain.schedule.profile import profile_model

pytestmark = pytest.mark.gpu
KEEP = [True, True, True, False]
PARTIAL = [True, False, True, False]


def _plans(tmp_path):
    kept, partial = tmp_path / "kept.json", tmp_path / "partial.json"
    kept.write_text(Schedule(homes=["gpu"] * 5, keep_graph=KEEP).to_json())
    partial.write_text(Schedule(homes=["gpu"] * 5, keep_graph=KEEP, mlp_recompute=PARTIAL).to_json())
    return LazyTrainStrategy(schedule=str(kept)), LazyTrainStrategy(schedule=str(partial))


@pytest.mark.parametrize("family", ["qwen2", "qwen3-moe"])
def test_gpu_fp32_mlp_recompute_matches_plain(tmp_path, family):
    model, data = tiny_model(family), batches(3, padded=True)
    plain, _ = train(model, data, accelerator="gpu")
    kept, partial = _plans(tmp_path)
    ref, _ = train(model, data, accelerator="gpu", strategy=kept)
    lt, _ = train(model, data, accelerator="gpu", strategy=partial)
    assert rel_diff(lt.model.cpu(), ref.model.cpu()) <= 1e-5
    assert rel_diff(lt.model.cpu(), plain.model.cpu()) <= 1e-5


def test_gpu_bf16_mixed_mlp_recompute_matches_all_kept(tmp_path):
    """The re-run happens in the backward, outside the forward's autocast: the checkpoint restores it, so the
    re-run saves the same bf16 tensors and the weights match the all-kept plan."""
    model, data = tiny_model("qwen2"), batches(3)
    kept, partial = _plans(tmp_path)
    ref, _ = train(model, data, accelerator="gpu", precision="bf16-mixed", strategy=kept)
    lt, _ = train(model, data, accelerator="gpu", precision="bf16-mixed", strategy=partial)
    assert update_rel_diff(model, lt.model.cpu(), ref.model.cpu()) <= 1e-3


def test_gpu_profile_measures_the_partial_graph(tmp_path):
    prof = profile_model(adapter_for(tiny_model("qwen2")), 2, 64, torch.device("cuda"), torch.bfloat16,
                         cache_dir=str(tmp_path))
    act = prof.activation_bytes[0]
    for g, part, rho, mu in zip(prof.graph_bytes, prof.mlp_graph_bytes, prof.forward_seconds, prof.mlp_seconds):
        assert act <= part < g, (act, part, g)  # at least the MLP's input, less than the whole graph
        assert 0 < mu < rho
