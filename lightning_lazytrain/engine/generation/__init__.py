"""Generation: evaluation-time `generate` with the layers resident or streamed, and the plan that picks one."""
