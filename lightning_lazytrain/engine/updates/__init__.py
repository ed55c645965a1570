"""Updates: per-unit optimizer steps on a CPU worker, on the device, or on this rank's shard."""
