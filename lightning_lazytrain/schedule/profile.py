"""Measure what the plan needs: per-layer forward time, boundary bytes, streamed bytes, link and disk bandwidth.

`profile_model` is the only place in `schedule/` that touches CUDA. On a CUDA device it times one copy of one
layer per distinct layer kind (``config.layer_types`` x parameter shapes) with CUDA events, the lm_head + loss on a
token chunk, pinned H2D / D2H / both-at-once copies, and the spill disk. Without CUDA the compute and link numbers
are analytic (`ANALYTIC_FLOPS`, REFERENCE.md's H200 link figures); the disk is still measured when a spill dir is
given. A layer's backward is not timed: it is its forward times the FLOPs ratio of `layer_backward.py` (2 where
every weight trains; a frozen LoRA base layer computes input gradients only). Results are cached as JSON per
machine + model shape and trainable weights + batch + seq + dtype (+ spill dir).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from lightning_lazytrain.engine.link import measure_link_cuda
from lightning_lazytrain.models.adapter import ModelAdapter
from lightning_lazytrain.models.fused_kernels import fused_count

from .layer_backward import FULL_BACKWARD_FACTOR, backward_ratio, flop_numel, streamed_bytes, trained_numel
from .layer_memory import LayerEstimates, analytic_layer_estimates, output_projection_seconds, trainable_bytes
from .measure import measure_head, measure_layers_fitting
from .spill_probe import measure_disk

# 3: the MLP re-run's graph bytes and seconds; 4: the re-run without the output projection; 5: each layer's backward
# and gradient bytes by which of its weights train, its streamed bytes as the store lays them out (4-bit weights)
PROFILE_VERSION = 5
ANALYTIC_FLOPS = 1e11  # FLOP/s assumed for analytic compute estimates (no CUDA device to measure on)
# REFERENCE.md, H200 benchmark machine: pinned PCIe per direction / both at once (total), disk write / read.
H200_H2D, H200_D2H, H200_DUPLEX = 55.5e9, 55.3e9, 101e9
DISK_WRITE, DISK_READ = 0.51e9, 1.28e9
NVME_PROBE_BYTES_GPU, NVME_PROBE_BYTES_CPU = 256 << 20, 16 << 20
SOURCE_KEYS = ("forward_seconds", "head_seconds", "h2d", "d2h", "duplex", "nvme_read", "nvme_write")
__all__ = ["Profile", "cache_key", "cache_path", "measure_disk", "profile_model"]


@dataclass
class Profile:
    """Measured (or estimated) facts of one model shape at one batch x seq on one machine.

    forward_seconds[j]: one forward of layer j (j = 0..L-1), no grad. activation_bytes[i]: boundary i (0..L),
    batch * seq * hidden * itemsize. param_bytes[j]: layer j's streamed parameter bytes (numel * itemsize of the
    stream dtype; a 4-bit weight as its packed codes and quant state). head_seconds: final norm + lm_head + loss,
    forward and backward. Bandwidths in bytes/s:
    h2d / d2h one direction alone, duplex_bytes_per_s the total of both directions running at once.
    graph_bytes[j] / working_bytes[j]: GPU bytes layer j's kept graph holds and the peak of its forward-with-grad
    and backward, both beyond its input boundary (`layer_memory.py`). sources[k] for k in SOURCE_KEYS: "measured"
    or "analytic". Empty memory lists: not profiled (the MILP then offers no kept graphs).
    mlp_graph_bytes[j] / mlp_seconds[j]: the graph bytes of layer j when its MLP re-runs in the backward, and one
    no-grad forward of its MLP; empty: not profiled (the MILP does not offer that choice).
    rerun_seconds[j]: one forward of layer j without its MLP's output projection, what its re-run in the backward
    computes (`engine/compute/gradient_only_linear.py`); empty: not profiled (``forward_seconds``).
    backward_seconds[j]: layer j's backward, its re-run aside: input gradients through every weight, weight
    gradients of the trainable ones only (`layer_backward.py`; a frozen LoRA base layer about 1x its forward);
    grad_bytes[j]: its trainable weights' gradients in the stream dtype, what goes back to the host (none for a
    frozen weight). Empty: not profiled, every weight trains (2x the forward, ``param_bytes``).
    """

    forward_seconds: list[float]
    activation_bytes: list[int]
    param_bytes: list[int]
    head_seconds: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    duplex_bytes_per_s: float
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float
    device_name: str
    sources: dict[str, str]
    batch: int = 0
    seq: int = 0
    dtype: str = ""
    layer_types: list[str] = field(default_factory=list)
    graph_bytes: list[int] = field(default_factory=list)
    working_bytes: list[int] = field(default_factory=list)
    mlp_graph_bytes: list[int] = field(default_factory=list)
    mlp_seconds: list[float] = field(default_factory=list)
    rerun_seconds: list[float] = field(default_factory=list)
    backward_seconds: list[float] = field(default_factory=list)
    grad_bytes: list[int] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.forward_seconds)
        if n < 1 or len(self.activation_bytes) != n + 1 or len(self.param_bytes) != n:
            raise ValueError(f"Profile needs L >= 1 forward_seconds, L+1 activation_bytes and L param_bytes; got "
                             f"{n}, {len(self.activation_bytes)}, {len(self.param_bytes)}")
        self.forward_seconds = [float(v) for v in self.forward_seconds]
        self.activation_bytes = [int(v) for v in self.activation_bytes]
        self.param_bytes = [int(v) for v in self.param_bytes]
        if {len(self.graph_bytes), len(self.working_bytes)} - {0, n}:
            raise ValueError(f"Profile needs L={n} graph_bytes and working_bytes (or none: not profiled), got "
                             f"{len(self.graph_bytes)}, {len(self.working_bytes)}")
        self.graph_bytes = [int(v) for v in self.graph_bytes]
        if len(self.mlp_graph_bytes) != len(self.mlp_seconds) or len(self.mlp_seconds) not in (0, n):
            raise ValueError(f"Profile needs L={n} mlp_graph_bytes and mlp_seconds (or none: not profiled), got "
                             f"{len(self.mlp_graph_bytes)}, {len(self.mlp_seconds)}")
        self.mlp_graph_bytes = [int(v) for v in self.mlp_graph_bytes]
        self.mlp_seconds = [float(v) for v in self.mlp_seconds]
        self.working_bytes = [int(v) for v in self.working_bytes]
        if len(self.rerun_seconds) not in (0, n):
            raise ValueError(f"Profile needs L={n} rerun_seconds (or none: not profiled), got "
                             f"{len(self.rerun_seconds)}")
        self.rerun_seconds = [float(v) for v in self.rerun_seconds]
        if len(self.backward_seconds) not in (0, n) or len(self.grad_bytes) not in (0, n):
            raise ValueError(f"Profile needs L={n} backward_seconds and grad_bytes (or none: every weight trains), "
                             f"got {len(self.backward_seconds)}, {len(self.grad_bytes)}")
        self.backward_seconds = [float(v) for v in self.backward_seconds]
        self.grad_bytes = [int(v) for v in self.grad_bytes]
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "duplex_bytes_per_s", "nvme_read_bytes_per_s",
                     "nvme_write_bytes_per_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"Profile.{name} must be > 0, got {getattr(self, name)!r}")
        if min(self.forward_seconds + self.backward_seconds) < 0 or float(self.head_seconds) < 0:
            raise ValueError("Profile times must be >= 0")
        bad = {k: v for k, v in self.sources.items() if v not in ("measured", "analytic")}
        if bad or set(self.sources) != set(SOURCE_KEYS):
            raise ValueError(f"Profile.sources needs exactly {SOURCE_KEYS} -> measured|analytic, got {self.sources}")

    @property
    def num_layers(self) -> int:
        return len(self.forward_seconds)

    @property
    def reruns(self) -> list[float]:
        """Each layer's re-run in the backward: ``rerun_seconds``, or ``forward_seconds`` where not profiled."""
        return self.rerun_seconds or self.forward_seconds

    @property
    def backwards(self) -> list[float]:
        """Each layer's backward, its re-run aside: ``backward_seconds``, or twice its forward where not profiled."""
        return self.backward_seconds or [FULL_BACKWARD_FACTOR * f for f in self.forward_seconds]

    @property
    def gradients(self) -> list[int]:
        """Each layer's gradient bytes back to the host: ``grad_bytes``, or ``param_bytes`` where not profiled."""
        return self.grad_bytes or self.param_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps({"version": PROFILE_VERSION, **self.to_dict()}, indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        if not isinstance(d, dict):
            raise ValueError("a profile must be a JSON object")
        d = dict(d)
        if d.pop("version", PROFILE_VERSION) != PROFILE_VERSION or set(d) - {f.name for f in fields(cls)}:
            raise ValueError(f"not a version-{PROFILE_VERSION} profile: keys {sorted(d)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))


def _attention_flops(config, layer_type: str, batch: int, seq: int) -> float:
    """Forward FLOPs of the token mixing not in the weights: causal QK^T + AV, or a chunked linear attention."""
    if layer_type == "linear_attention":
        dv = getattr(config, "linear_num_value_heads", 0) * getattr(config, "linear_value_head_dim", 0)
        return 4.0 * batch * seq * min(seq, 64) * dv  # chunk-64 gated delta rule, linear in seq
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 4.0 * batch * seq * seq * config.num_attention_heads * head_dim * 0.5


def head_flops(adapter: ModelAdapter, tokens: int) -> float:
    """FLOPs of the head's matmul for ``tokens`` tokens, forward and backward: 6 per weight and token, 4 for a
    frozen head (no weight gradient)."""
    weight = adapter.lm_head.weight
    return (4.0 + 2.0 * weight.requires_grad) * weight.numel() * tokens


def _measure(adapter: ModelAdapter, batch: int, seq: int, device: torch.device, stream_dtype: torch.dtype,
             spill_dir: str | None) -> Profile:
    """Measure (CUDA) or estimate (otherwise) everything; no caching here."""
    config = adapter.model.config
    itemsize = stream_dtype.itemsize
    n, tokens, types = adapter.num_layers, batch * seq, adapter.layer_types()
    numel = [flop_numel(layer) for layer in adapter.layers]
    mixing = [_attention_flops(config, types[j], batch, seq) for j in range(n)]
    cuda = device.type == "cuda"
    src = dict.fromkeys(SOURCE_KEYS, "measured" if cuda else "analytic")
    measured_rows = None  # CUDA: the rows one layer was measured at (fewer than the batch's when it did not fit)
    if cuda:
        measured, measured_rows = measure_layers_fitting(adapter, batch, seq, device, stream_dtype)
        per_layer = [measured[j] for j in range(n)]
        forward, rerun = [m.forward_seconds for m in per_layer], [m.rerun_seconds for m in per_layer]
        layers = LayerEstimates(graph_bytes=[m.graph_bytes for m in per_layer],
                                working_bytes=[m.working_bytes for m in per_layer],
                                mlp_graph_bytes=[m.mlp_graph_bytes for m in per_layer],
                                mlp_seconds=[m.mlp_seconds for m in per_layer])
        torch.cuda.empty_cache()
        head = measure_head(adapter, tokens, device, stream_dtype)
        h2d, d2h, duplex = measure_link_cuda(device)
        name = torch.cuda.get_device_name(device)
    else:
        forward = [(2.0 * numel[j] * tokens + mixing[j]) / ANALYTIC_FLOPS for j in range(n)]
        rerun = [f - d for f, d in zip(forward, output_projection_seconds(adapter, tokens, ANALYTIC_FLOPS))]
        layers = analytic_layer_estimates(adapter, tokens, itemsize, ANALYTIC_FLOPS)
        head = head_flops(adapter, tokens) / ANALYTIC_FLOPS
        h2d, d2h, duplex = H200_H2D, H200_D2H, H200_DUPLEX
        name = f"cpu:{platform.processor() or platform.machine()}"
    read, write, src["nvme_read"] = DISK_READ, DISK_WRITE, "analytic"
    if spill_dir is not None:
        read, write = measure_disk(spill_dir, NVME_PROBE_BYTES_GPU if cuda else NVME_PROBE_BYTES_CPU)
        src["nvme_read"] = "measured"
    src["nvme_write"] = src["nvme_read"]
    act = batch * seq * config.hidden_size * itemsize
    decoder = list(adapter.layers)
    backward = [backward_ratio(layer, mixing[j], tokens) * forward[j] for j, layer in enumerate(decoder)]
    return Profile(forward_seconds=forward, activation_bytes=[act] * (n + 1),
                   param_bytes=[streamed_bytes(layer, itemsize) for layer in decoder],
                   backward_seconds=backward, grad_bytes=[trainable_bytes(layer, itemsize) for layer in decoder],
                   head_seconds=head, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, duplex_bytes_per_s=duplex,
                   nvme_read_bytes_per_s=read, nvme_write_bytes_per_s=write, device_name=name, sources=src,
                   batch=batch, seq=seq, dtype=str(stream_dtype).replace("torch.", ""), layer_types=types,
                   rerun_seconds=rerun, **asdict(layers),
                   info={"analytic_flops": None if cuda else ANALYTIC_FLOPS, "working_set": src["forward_seconds"],
                         "spill_dir": spill_dir, "measured_rows": measured_rows})


def cache_key(adapter: ModelAdapter, batch: int, seq: int, device: torch.device, stream_dtype: torch.dtype,
              spill_dir: str | None = None) -> dict:
    """What identifies a profile: machine, device, library versions, model shape, batch, seq, dtype, spill dir,
    how many of the layers' modules run Liger's kernels, and each layer's weights and trainable ones (a LoRA model
    has the base's config, adapters beside it and a frozen base)."""
    import transformers

    cfg = {k: v for k, v in adapter.model.config.to_dict().items()
           if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash")}
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"version": PROFILE_VERSION, "host": socket.gethostname(), "machine": platform.machine(),
            "device": f"{device.type}:{dev}", "torch": torch.__version__, "transformers": transformers.__version__,
            "config": json.loads(json.dumps(cfg, sort_keys=True, default=str)), "batch": int(batch), "seq": int(seq),
            "dtype": str(stream_dtype), "spill_dir": None if spill_dir is None else os.path.abspath(spill_dir),
            "fused_kernels": fused_count(adapter.layers),
            "layer_params": [[flop_numel(layer), trained_numel(layer)] for layer in adapter.layers],
            "head_trains": bool(adapter.lm_head.weight.requires_grad)}


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "lightning_lazytrain" / "profiles"


def cache_path(key: dict, cache_dir: str | None = None) -> Path:
    sha = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"{sha}.json"


def _load_cached(path: Path, key: dict) -> Profile | None:
    try:
        d = json.loads(path.read_text())
        return Profile.from_dict(d["profile"]) if d.get("key") == key else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # missing or corrupt: measure again and overwrite


def profile_model(adapter: ModelAdapter, batch: int, seq: int, device: torch.device,
                  stream_dtype: torch.dtype = torch.bfloat16, spill_dir: str | None = None,
                  cache_dir: str | None = None, use_cache: bool = True) -> Profile:
    """Profile ``adapter``'s model at ``batch`` x ``seq`` on ``device``; read from / written to the cache.

    The cache file is ``cache_dir/<sha of cache_key(...)>.json`` (default ~/.cache/lightning_lazytrain/profiles);
    a file that does not parse or whose key differs is ignored and rewritten (atomically).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = cache_key(adapter, batch, seq, device, stream_dtype, spill_dir)
    path = cache_path(key, cache_dir)
    if use_cache and (cached := _load_cached(path, key)) is not None:
        return cached
    prof = _measure(adapter, batch, seq, device, stream_dtype, spill_dir)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "profile": {"version": PROFILE_VERSION, **prof.to_dict()}}, indent=2))
        os.replace(tmp, path)
    return prof
