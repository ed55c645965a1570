"""Issue 14 §2 on the H200: decode tokens/s of evaluation-time generation, Qwen2.5-7B shape, random init, bf16.

    LAZYTRAIN_COMMIT=$(git rev-parse --short HEAD) python benchmarks/generate_gpu.py
    python benchmarks/generate_gpu.py --tiny        # a CPU dry run of the same code with a tiny config

Three runs, each in its own process (so one's device memory does not shape another's):

- ``hf``: plain HF ``generate`` with the whole model resident on the GPU (the reference);
- ``resident``: ``LazyTrainStrategy(generation="resident")`` under ``Trainer.validate``: the masters live in host
  memory and the layers are loaded onto the GPU once for the evaluation (``load_s``, not in the decode times);
- ``streamed``: ``generation="streamed"``: every decode step streams all layers, once for the whole batch.

Prompts are random tokens of ``--prompt-tokens`` each; ``min_new_tokens`` = ``max_new_tokens`` so every run
decodes exactly that many tokens. tokens/s = prompts x new tokens / wall seconds of the ``generate`` call
(prefill included). Writes ``--out`` (command, commit, machine, versions, rows) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

MODES = ("hf", "resident", "streamed")
TINY = dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def _config(tiny: bool):
    from transformers import AutoConfig

    from lightning_lazytrain.sft.module import NAMED_SHAPES

    fields = dict(TINY if tiny else NAMED_SHAPES["qwen2.5-7b"])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _prompts(n: int, tokens: int, vocab: int, device: str) -> torch.Tensor:
    return torch.randint(0, vocab, (n, tokens), generator=torch.Generator().manual_seed(n)).to(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_generate(model, ids: torch.Tensor, new: int, device: str) -> tuple[float, torch.Tensor]:
    _sync(device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0)
    _sync(device)
    return time.perf_counter() - start, out[:, ids.shape[1]:].cpu()


def _measure(model, args, device: str, plan_of=lambda: None) -> dict:
    """A short warm-up call (in resident mode: the layers' copy onto the device), then each shape once."""
    vocab = model.config.vocab_size
    load_s, _ = _timed_generate(model, _prompts(2, args.prompt_tokens, vocab, device), 2, device)
    rows, sample = [], None
    for n, new in _shapes(args.streamed_shapes if args.mode == "streamed" else args.shapes):
        seconds, out = _timed_generate(model, _prompts(n, args.prompt_tokens, vocab, device), new, device)
        if sample is None:
            sample = out.flatten().tolist()
        plan = plan_of()
        rows.append({"mode": args.mode, "prompts": n, "prompt_tokens": args.prompt_tokens, "new_tokens": new,
                     "seconds": seconds, "tokens_per_s": n * new / seconds,
                     "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                     "plan": plan.describe() if plan is not None else None})
        print(f"[{args.mode}] {n} prompts x {new} new tokens: {seconds:.2f} s, {n * new / seconds:.1f} tok/s",
              file=sys.stderr, flush=True)
    return {"mode": args.mode, "load_s": load_s, "rows": rows, "sample_tokens": sample}


def _child(args) -> dict:
    import lightning.pytorch as pl
    from transformers import AutoModelForCausalLM

    from lightning_lazytrain import LazyTrainStrategy

    device = "cpu" if args.tiny else "cuda"
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device(device):  # random init on the GPU: a 7B model initialised on the CPU takes minutes
        model = AutoModelForCausalLM.from_config(_config(args.tiny), dtype=torch.bfloat16)
    model.eval()
    build_s = time.perf_counter() - start
    if args.mode == "hf":
        with torch.inference_mode():
            result = _measure(model, args, device)
        return {**result, "build_s": build_s}

    class Evaluate(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.result = model, None

        def validation_step(self, batch, batch_idx):
            self.result = _measure(self.model, args, device, lambda: self.trainer.strategy.generation.last_plan)

    module = Evaluate()
    trainer = pl.Trainer(accelerator="cpu" if args.tiny else "gpu", devices=1, precision="bf16-true",
                         strategy=LazyTrainStrategy(generation=args.mode), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    start = time.perf_counter()
    trainer.validate(module, torch.utils.data.DataLoader([torch.zeros(1)], batch_size=None))
    return {**module.result, "build_s": build_s, "setup_and_run_s": time.perf_counter() - start}


def _parent(args) -> None:
    started = time.perf_counter()
    results = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--child", mode, "--shapes", args.shapes, "--streamed-shapes",
               args.streamed_shapes, "--prompt-tokens", str(args.prompt_tokens)] + (["--tiny"] if args.tiny else [])
        try:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.child_timeout_s)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            results[mode] = json.loads(lines[-1][7:]) if lines else {"status": f"exit {done.returncode}, no result"}
        except subprocess.TimeoutExpired:
            results[mode] = {"status": f"timed out after {args.child_timeout_s} s"}
    hf = {(r["prompts"], r["new_tokens"]): r["tokens_per_s"] for r in results["hf"].get("rows", [])}
    reference = results["hf"].get("sample_tokens")
    for mode in MODES:
        for row in results[mode].get("rows", []):
            ref = hf.get((row["prompts"], row["new_tokens"]))
            row["vs_hf"] = row["tokens_per_s"] / ref if ref else None
        sample = results[mode].get("sample_tokens")
        if sample and reference and len(sample) == len(reference):
            # bf16 rounding differs between the resident HF model and the engine's copies: a share, not equality
            results[mode]["sample_tokens_equal_hf"] = sum(a == b for a, b in zip(sample, reference)) / len(sample)
        results[mode].pop("sample_tokens", None)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write_results

    write_results(args.out, {"shape": "tiny" if args.tiny else "qwen2.5-7b", "dtype": "bfloat16",
                             "wall_s": time.perf_counter() - started, "results": results})
    print(f"{'prompts x new':>14} " + " ".join(f"{m + ' tok/s':>16}" for m in MODES))
    for n, new in _shapes(args.shapes):
        cells = []
        for mode in MODES:
            row = next((r for r in results[mode].get("rows", []) if (r["prompts"], r["new_tokens"]) == (n, new)), None)
            ratio = f" ({row['vs_hf']:.2f}x)" if row and row.get("vs_hf") and mode != "hf" else ""
            cells.append(f"{row['tokens_per_s']:.1f}{ratio}" if row else results[mode].get("status", "-"))
        print(f"{f'{n} x {new}':>14} " + " ".join(f"{c:>16}" for c in cells))
    loads = {m: results[m].get("load_s") for m in MODES}
    print(f"warm-up call (resident: includes loading the layers) s: {loads}; results in {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU dry run with a 2-layer config")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/generate_<commit>_<machine>.json")
    parser.add_argument("--shapes", default=None, help="prompts x new tokens, e.g. 16x32,128x256")
    parser.add_argument("--streamed-shapes", default=None, help="shapes for the streamed run (it is the slow one)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--child-timeout-s", type=int, default=300)
    parser.add_argument("--child", dest="mode", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.shapes = args.shapes or ("4x8,8x16" if args.tiny else "16x32,128x32,16x256,128x256")
    args.streamed_shapes = args.streamed_shapes or ("4x8,8x16" if args.tiny else "16x32,128x32,128x256")
    tiny_out = os.path.join(tempfile.gettempdir(), "generate_tiny.json") if args.tiny else None
    if args.out is None and tiny_out is None:
        from common import default_out

        args.out = default_out("generate")
    args.out = args.out or tiny_out
    if args.mode is None:
        _parent(args)
        return
    result = _child(args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
