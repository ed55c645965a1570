"""Shared pieces of the GPU benchmarks: Qwen shapes, random data, a CUDA-event step timer, result files."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import lightning.pytorch as pl
import psutil
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

try:
    from lightning_lazytrain.optim import kernel_path
except ImportError:  # benchmarks/ab_gpu.py runs this harness over checkouts older than kernel_path

    def kernel_path() -> str:
        return "not reported by this checkout"

SHAPES = {
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, tie_word_embeddings=False),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, tie_word_embeddings=False),
    # CPU dry runs of the scripts; a small vocabulary, since bf16 matmuls through Qwen's 151936-row head take
    # minutes on a CPU without bf16 instructions
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False, vocab_size=4096),
}
GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def qwen_config(shape: str) -> Qwen2Config:
    return Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                       **{"vocab_size": 151936, **SHAPES[shape]})


def random_model(shape: str, device: str = DEVICE, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(qwen_config(shape), dtype=dtype)


def allocator_env(system: str) -> dict[str, str]:
    """The allocator setting a lazytrain user gets (the ``lazytrain`` command and the strategy ask for expandable
    segments before CUDA starts; the harness builds models on the GPU first, so it sets it for the child); the
    baselines keep torch's default. A setting in the caller's environment wins."""
    if not system.startswith("lazytrain") or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def cap_gpu_memory(gib: float) -> None:
    """Emulate a smaller GPU (80 GiB: H800-class, 24 GiB: 3090-class) on the H200."""
    if not GPU:
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))


def host_model(shape: str, dtype: torch.dtype = torch.float32):
    """A random-init model initialised on the GPU (fast) and handed over in host memory, as lazytrain takes it."""
    model = random_model(shape, DEVICE, torch.bfloat16).to("cpu", dtype)
    if GPU:
        torch.cuda.empty_cache()
    return model


def model_flops_per_token(cfg: Qwen2Config, num_params: int, seq: int) -> float:
    """The convention of REFERENCE.md: 6N plus the attention term 12 * layers * hidden * seq."""
    return 6 * num_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, steps: int, batch: int, seq: int, vocab: int = 151936) -> None:
        gen = torch.Generator().manual_seed(0)
        self.items = [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(steps)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.items[i], "labels": self.items[i]}


class NullUpdate(torch.optim.Optimizer):
    """An optimizer the engine can drive that updates nothing: isolates forward + backward + gradient D2H."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.0})

    def step(self, closure=None):
        return closure() if closure is not None else None

    def step_params(self, params, clip_coef=1.0, grads=None, lr_of=None) -> None:
        pass

    def register_stream_copy(self, param, copy) -> None:
        pass


class BenchModule(pl.LightningModule):
    """optimizer: 'adamw' (torch, fused on the CPU), 'adamw-default' (torch's defaults), 'hybrid0' / 'hybrid1'
    (HybridAdamW, 8-bit fraction 0 / 1), 'deepspeed' (DeepSpeedCPUAdam), 'null'."""

    def __init__(self, model, optimizer: str = "adamw") -> None:
        super().__init__()
        self.model = model
        self.optimizer_name = optimizer

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        kw = dict(lr=1e-5, weight_decay=0.01)
        if self.optimizer_name == "null":
            return NullUpdate(self.parameters())
        if self.optimizer_name == "deepspeed":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(self.parameters(), **kw)
        if self.optimizer_name.startswith("hybrid"):
            from lightning_lazytrain.optim import HybridAdamW

            return HybridAdamW(self.parameters(), eight_bit_fraction=float(self.optimizer_name[6:]), **kw)
        if self.optimizer_name == "adamw-default":
            return torch.optim.AdamW(self.parameters(), **kw)
        on_cpu = next(self.model.parameters()).device.type == "cpu"
        return torch.optim.AdamW(self.parameters(), fused=True if on_cpu else None, **kw)


class WallEvent:
    """A CPU stand-in for a CUDA timing event, for dry runs without a GPU."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: WallEvent) -> float:
        return (other.t - self.t) * 1e3


def median_seconds(fn, reps: int, warm: int = 0) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after ``warm`` untimed ones: CUDA events around each call on a
    GPU, the wall clock elsewhere (a microbenchmark's own call, not a training step)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True) if GPU else WallEvent()
        if GPU:
            start.record()
        fn()
        end = torch.cuda.Event(enable_timing=True) if GPU else WallEvent()
        if GPU:
            end.record()
            end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


class ChunkedLossModule(BenchModule):
    """The GPU-resident model with the head's loss in chunks, as lazytrain's head runs it: Liger's fused linear
    cross-entropy never holds the whole batch's logits (HF's loss holds them, and an fp32 copy)."""

    def __init__(self, model) -> None:
        super().__init__(model, "adamw")

    def training_step(self, batch, batch_idx):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        hidden = self.model.model(input_ids=batch["input_ids"]).last_hidden_state
        inputs = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # position t predicts token t + 1, as HF's loss
        return LigerFusedLinearCrossEntropyLoss()(self.model.lm_head.weight, inputs, batch["labels"][:, 1:].reshape(-1))


class StepTimer(pl.Callback):
    """CUDA events at batch start, before the optimizer step and at batch end; read only after the run.
    ``update_share``: the share of the update on the GPU, read from the strategy at each batch end (before teardown
    drops what it reads)."""

    def __init__(self, update_share=None) -> None:
        self.update_share = update_share
        self.gpu_update_share: float | None = None
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: list[torch.cuda.Event] = []
        self.stats: list[dict] = []
        self.rss_max = 0
        self.plan = None
        self.fused_modules = None

    def _event(self) -> torch.cuda.Event:
        if not GPU:
            return WallEvent()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def on_train_batch_start(self, trainer, *args):
        self._open = [self._event()]

    def on_before_optimizer_step(self, trainer, *args):
        self._open.append(self._event())

    def on_train_batch_end(self, trainer, *args):
        self._open.append(self._event())
        self.marks.append(tuple(self._open))
        self.stats.append(dict(getattr(trainer.strategy, "last_step_stats", {}) or {}))
        self.plan = getattr(getattr(trainer.strategy, "executor", None), "plan", None)
        self.fused_modules = getattr(getattr(trainer.strategy, "executor", None), "fused_modules", None)
        self.rss_max = max(self.rss_max, psutil.Process().memory_info().rss)
        if self.update_share is not None:
            self.gpu_update_share = self.update_share(trainer.strategy)

    def summary(self, warmup: int) -> dict:
        if GPU:
            torch.cuda.synchronize()
        rows = self.marks[warmup:]
        starts = [m[0] for m in self.marks]
        intervals = [starts[i].elapsed_time(starts[i + 1]) / 1e3 for i in range(len(starts) - 1)]
        step = intervals[warmup:]
        fwd_bwd = [a.elapsed_time(b) / 1e3 for a, b, _ in rows]
        opt = [b.elapsed_time(c) / 1e3 for _, b, c in rows]
        last = [a.elapsed_time(c) / 1e3 for a, _, c in rows]
        # the engine's counters of the same steps whose intervals are timed, median per counter: the last step's
        # alone (as before) described another step than the one interval a 3-step run times
        timed = self.stats[warmup : warmup + len(step)] or self.stats[-1:]
        engine = {}
        for k in timed[0] if timed else {}:
            seen = [st.get(k) for st in timed]
            engine[k] = statistics.median(seen) if all(isinstance(v, (int, float)) for v in seen) else seen[-1]
        return {
            "step_s": statistics.median(step) if step else statistics.median(last),
            "step_s_each": intervals,  # batch start to batch start, every step, the warm-up ones first
            "fwd_bwd_s": statistics.median(fwd_bwd),
            "optimizer_s": statistics.median(opt),
            "steps_timed": len(step) or len(rows),
            "engine": engine,
            "host_rss_max_gib": self.rss_max / 2**30,
            # modules of the streamed layers running Liger's kernels (None: not a lazytrain run)
            "fused_kernel_modules": self.fused_modules,
            "gpu_update_share": self.gpu_update_share,
        }


def run_fit(module, strategy, precision: str, data, timer: StepTimer, **kw) -> None:
    """One Lightning fit with the timer; ``kw`` goes to the Trainer (e.g. gradient_clip_val)."""
    trainer = pl.Trainer(accelerator="gpu" if GPU else "cpu", devices=1, strategy=strategy, precision=precision,
                         max_steps=len(data), logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer], num_sanity_val_steps=0, **kw)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))


def host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def machine() -> dict:
    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return {"gpu": props.name if props else None, "gpu_gib": props.total_memory / 2**30 if props else None,
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "lightning": pl.__version__,
            # the update path HybridAdamW's CPU tensors take here (fused kernel's SIMD level, or torch)
            "hybrid_adamw_kernel_path": kernel_path(), "liger_kernel": _version("liger-kernel")}


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def commit() -> str:
    """``LAZYTRAIN_COMMIT``, else the checkout's HEAD. On the lent device machine the copied tree's git named an older
    HEAD than the tree that ran (2026-12-06), so write the local commit into the command there, not a
    ``$(git rev-parse ...)`` that the device evaluates."""
    if os.environ.get("LAZYTRAIN_COMMIT"):
        return os.environ["LAZYTRAIN_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("LAZYTRAIN_COMMIT", "unknown")


def default_out(group: str) -> str:
    """``benchmarks/results/<group>_<commit>_<machine>.json`` for this checkout and machine (results_index.py)."""
    from results_index import machine_class, result_path

    return result_path(group, machine_class(machine()), commit())


def write_results(path: str, payload: dict) -> None:
    payload = {"command": " ".join([sys.executable.split("/")[-1], *sys.argv]), "commit": commit(),
               "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]], width: int = 40) -> None:
    """The short table a benchmark prints last: ``columns`` are (key, header, format spec)."""
    print(f"{'run':{width}} " + " ".join(f"{header:>9}" for _, header, _ in columns))
    for r in rows:
        if r.get("status") == "ok":
            print(f"{r['variant']:{width}} " + " ".join(f"{r[key]:>9{spec}}" for key, _, spec in columns))
        else:
            print(f"{r['variant']:{width}} {r.get('status')}")
