"""Activations: where each layer boundary lives between the forward and the backward (GPU, CPU, NVMe)."""
