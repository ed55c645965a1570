"""Loss: the causal-LM loss through the head in row chunks (the logits never whole), its Triton kernel on CUDA."""
