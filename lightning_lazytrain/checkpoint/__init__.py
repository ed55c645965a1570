"""Checkpoints: atomic, verified Lightning checkpoint files; sharded directories of several processes; HF export."""

from lightning_lazytrain.checkpoint.atomic import AtomicCheckpointIO, CorruptCheckpointError, find_last_good
from lightning_lazytrain.checkpoint.hf_export import export_hf

__all__ = ["AtomicCheckpointIO", "CorruptCheckpointError", "export_hf", "find_last_good"]
