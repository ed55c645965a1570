"""One decoder layer's GPU memory, measured against the estimate the CPU uses (and `lazytrain plan` forecasts with).

    python benchmarks/layer_memory_gpu.py --out benchmarks/results/layer_memory_<commit>_<machine>.json

Per shape and batch (seq 1024, bf16, sdpa): the kept graph's bytes, the forward+backward peak and the graph with
the MLP re-run in the backward, measured on CUDA (``schedule/layer_memory.py``'s ``measure_*``) and estimated from
the config (``analytic_*``), and their ratio. A ratio above 1 means the estimate is short: a plan made from it
would promise more than the GPU holds.
"""

from __future__ import annotations

import argparse
import copy

import torch
from common import DEVICE, print_table, qwen_config, write_results
from transformers import AutoModelForCausalLM

from lightning_lazytrain.models.adapter import adapter_for
from lightning_lazytrain.schedule.layer_memory import (
    analytic_layer_memory,
    analytic_mlp_recompute_graph,
    measure_layer_memory,
    measure_mlp_recompute_graph,
)
from lightning_lazytrain.schedule.timing import rotary_inputs

GIB = 2**30


def _row(shape: str, batch: int, seq: int) -> dict:
    config = copy.deepcopy(qwen_config(shape))
    config.num_hidden_layers = 1
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    adapter = adapter_for(model)
    layer = adapter.layers[0]
    h = torch.randn(batch, seq, config.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    pos, pe = rotary_inputs(adapter.rotary, h, batch, seq)
    kwargs = {"attention_mask": None, "position_ids": pos, "position_embeddings": pe}
    param_bytes = sum(p.numel() for p in layer.parameters()) * 2
    graph, peak = measure_layer_memory(layer, h, kwargs)
    partial = measure_mlp_recompute_graph(layer, h, kwargs)
    est_graph, est_peak = analytic_layer_memory(config, "full_attention", batch * seq, 2, param_bytes)
    est_partial = analytic_mlp_recompute_graph(config, "full_attention", batch * seq, 2)
    del model, layer, adapter, h
    torch.cuda.empty_cache()
    return {"shape": shape, "batch": batch, "seq": seq, "param_gib": param_bytes / GIB,
            "graph_gib": graph / GIB, "graph_est_gib": est_graph / GIB, "graph_ratio": graph / est_graph,
            "peak_gib": peak / GIB, "peak_est_gib": est_peak / GIB, "peak_ratio": peak / est_peak,
            "mlp_graph_gib": partial / GIB, "mlp_graph_est_gib": est_partial / GIB,
            "mlp_graph_ratio": partial / est_partial}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [_row(shape, b, args.seq) for shape in args.shapes for b in args.batches]
    write_results(args.out, {"rows": rows})
    for r in rows:
        r.update(variant=f"{r['shape']} b{r['batch']}", status="ok")
    print_table(rows, [("graph_gib", "graph", ".2f"), ("graph_ratio", "meas/est", ".3f"), ("peak_gib", "peak", ".2f"),
                       ("peak_ratio", "meas/est", ".3f"), ("mlp_graph_gib", "mlp graph", ".2f"),
                       ("mlp_graph_ratio", "meas/est", ".3f")], width=20)


if __name__ == "__main__":
    main()
