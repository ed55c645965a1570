"""Compute: the layers run on the device: the model's hooked forward, the decoder stack as one autograd Function, and
the per-call overrides of a layer (kept graph without the MLP, gradient-only output projection, row micro-batches)."""
