"""Gradients out: host accumulation, direct per-unit bf16 landing, sharded reduce-scatter."""
