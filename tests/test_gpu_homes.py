"""CPU and NVMe activation homes on a CUDA device: copy streams, record_stream, pinned buffers and the NVMe threads.

Run on one H200: ``python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_homes.py -s``.
"""

import os
import time

import lightning.pytorch as pl
import pytest
import torch
from helpers import batches, loader, rel_diff, tiny_model, train
from test_engine_updates import HybridModule
from transformers import AutoModelForCausalLM, Qwen2Config

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.engine.activations.homes import ActivationHomes
from lightning_lazytrain.engine.device import DeviceQueues
from lightning_lazytrain.engine.weights.pinned import PinnedAllocator
from lightning_lazytrain.schedule import Schedule

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "homes",
    [
        ["gpu", "cpu", "nvme", "recompute", "gpu"],
        ["gpu", "nvme", "nvme", "cpu", "gpu"],
        ["gpu", "cpu", "cpu", "cpu", "gpu"],
    ],
    ids=["mixed", "spill-heavy", "all-cpu"],
)
def test_gpu_cpu_and_nvme_homes_match_all_gpu(tmp_path, homes):
    model, data = tiny_model("qwen2"), batches(3, padded=True)
    spill = tmp_path / "spill"
    spill.mkdir()
    ref, _ = train(model, data, accelerator="gpu", strategy=LazyTrainStrategy(schedule="interval:1"))
    plan = tmp_path / "plan.json"
    plan.write_text(Schedule(homes=homes).to_json())
    lt, trainer = train(
        model, data, accelerator="gpu", strategy=LazyTrainStrategy(schedule=str(plan), spill_dir=str(spill))
    )
    stats = trainer.strategy.last_step_stats
    assert stats["act_offload_bytes"] > 0
    if "nvme" in homes:
        assert stats["act_nvme_write_bytes"] > 0 and stats["act_nvme_read_bytes"] > 0
    # the same kernels run in both (fp32, every layer re-run once): only the boundaries' trips differ
    assert rel_diff(lt.model.cpu(), ref.model.cpu()) <= 1e-6
    assert os.listdir(spill) == [], "spill files and the run's folder are gone after teardown"


class _StepClock(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[tuple[float, dict]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self.rows.append((time.perf_counter() - self._t0, dict(trainer.strategy.last_step_stats)))


def test_3b_plan_with_cpu_and_nvme_homes_predicted_vs_measured_stall(tmp_path):
    """Qwen2.5-3B shape at batch 32 x 1024 with a 1 GiB GPU activation budget: the MILP must use CPU and NVMe
    homes; each step's measured stall is printed beside the plan's prediction (issue 16's P5 asks for within 2x)."""
    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": (ids := torch.randint(0, cfg.vocab_size, (32, 1024), generator=gen)), "labels": ids}
        for _ in range(5)
    ]
    spill = tmp_path / "spill"
    spill.mkdir()
    clock = _StepClock()
    strategy = LazyTrainStrategy(schedule="milp", gpu_activation_gib=1.0, spill_dir=str(spill))
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        gradient_clip_val=1.0,
        callbacks=[clock],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(HybridModule(model, fraction=1.0), loader(data))
    plan = strategy.schedule_result
    counts = plan.counts()
    assert counts["cpu"] > 0 and counts["nvme"] > 0, counts
    predicted = plan.predicted_exposed_seconds
    for step, (secs, stats) in enumerate(clock.rows):
        print(
            f"step {step}: {secs:.3f} s, stall measured {stats['stall_s']:.4f} s, predicted {predicted:.4f} s, "
            f"offloaded {stats['act_offload_bytes'] / 2**30:.2f} GiB, nvme written "
            f"{stats['act_nvme_write_bytes'] / 2**30:.2f} GiB; plan {counts}, {sum(plan.keep_graph)} kept graphs"
        )
    steady = clock.rows[2:]
    step_s = sum(s for s, _ in steady) / len(steady)
    stall_s = sum(r["stall_s"] for _, r in steady) / len(steady)
    print(
        f"steady: step {step_s:.3f} s, stall {stall_s:.4f} s ({100 * stall_s / step_s:.1f}%), "
        f"predicted {predicted:.4f} s"
    )
    assert stall_s <= 0.05 * step_s  # measured 2.4% at commit a278320
    idle_s = sum(r["gpu_idle_s"] for _, r in steady) / len(steady)
    busy_s = sum(r["gpu_layer_busy_s"] for _, r in steady) / len(steady)
    print(f"GPU from CUDA events: layers busy {busy_s:.3f} s, idle inside the stack {idle_s:.3f} s")
    assert 0 < busy_s and 0 <= idle_s and busy_s + idle_s <= step_s
    assert os.listdir(spill) == []


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_gpu_compute_reads_a_reloaded_boundary_only_after_its_copy(tmp_path, home):
    """The reload stream is held back by a long sleep kernel queued on it before the reload: what the compute
    stream reads from ``get`` is still the boundary, because it waits for the reload stream, not the weight one."""
    queues, pinned = DeviceQueues(torch.device("cuda")), PinnedAllocator(True)
    store = ActivationHomes(queues, ["gpu", home, "gpu"], pinned, str(tmp_path))
    x = torch.randn(2048, 4096, device="cuda")
    store.put(1, x)
    store.flush()
    with torch.cuda.stream(queues.reload):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles
    seen = store.get(1).clone()
    torch.cuda.synchronize()
    assert torch.equal(seen, x)
    store.close()
    pinned.release()


def test_gpu_a_refused_host_register_leaves_no_error_for_the_next_kernel():
    """Registering a range twice is refused; the allocator falls back, and the next kernel launch must not raise
    the refusal (the runtime's last error) as its own."""
    from lightning_lazytrain.engine.weights.pinned import _register

    host = torch.empty(1 << 20, dtype=torch.uint8)
    assert _register(host, host.numel())
    assert not _register(host, host.numel())
    torch.ones(4, device="cuda").add_(1)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
