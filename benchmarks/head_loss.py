"""The chunked head loss, forward and backward, timed on whatever device is here (CUDA events or wall clock).

    python benchmarks/head_loss.py --out benchmarks/results/head_loss_<commit>_<machine>.json
    PYTHONPATH=<other checkout> python benchmarks/head_loss.py ...   # the same for another version of the library

Rows of ``--rows`` tokens through a head of ``--vocab`` x ``--hidden``, in chunks of ``--chunk-mib`` of fp32 logits;
the median of ``--reps`` runs after one warm-up. ``--dtype bfloat16`` is the engine's case: a bf16 head and hidden
state under bf16 autocast.
"""

from __future__ import annotations

import argparse

import torch
from common import DEVICE, median_seconds, write_results

from lightning_lazytrain.engine.loss.chunked import chunked_causal_lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    hidden = torch.randn(1, args.rows, args.hidden, generator=gen).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(DEVICE, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.rows), generator=gen).to(DEVICE)
    chunk = args.chunk_mib << 20

    autocast = torch.autocast(DEVICE, dtype=dtype, enabled=dtype != torch.float32)

    def forward_backward() -> None:
        hidden.grad = weight.grad = None
        with autocast:
            loss = chunked_causal_lm_loss(hidden, weight, labels, chunk_bytes=chunk)
        loss.backward()

    def forward_only() -> None:
        with torch.no_grad(), autocast:
            chunked_causal_lm_loss(hidden, weight, labels, chunk_bytes=chunk)

    row = {"rows": args.rows, "hidden": args.hidden, "vocab": args.vocab, "chunk_mib": args.chunk_mib,
           "dtype": args.dtype, "threads": torch.get_num_threads(),
           "forward_backward_s": median_seconds(forward_backward, args.reps, warm=1),
           "forward_no_grad_s": median_seconds(forward_only, args.reps, warm=1)}
    write_results(args.out, {"rows": [row]})
    print(row)


if __name__ == "__main__":
    main()
