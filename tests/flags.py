"""XLA flags for worker processes; imports no JAX, so workers set them first."""

import os


def xla_flags(n_devices: int) -> str:
    """XLA_FLAGS for a worker process with `n_devices` CPU devices, keeping the
    suite's other flags (its optimization level)."""
    kept = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={n_devices}"])
