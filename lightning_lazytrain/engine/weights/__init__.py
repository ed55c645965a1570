"""Weights in: the host store of masters and the streamed copy, pinned memory, device slots, binding."""
