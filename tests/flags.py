"""XLA flags for worker processes; imports no JAX, so workers set them first."""

import importlib.metadata
import os

SERIAL_CODEGEN = "--xla_cpu_parallel_codegen_split_count=1"
r"""One codegen module instead of parallel splits: less work on two cores
shared by two test workers (a compile setting, not an optimization level)."""


def _has_elemental_emitters() -> bool:
    r"""Whether XLA's CPU backend still has its older elemental emitters (a
    jaxlib before 0.11; a newer one aborts on the flag that chooses them)."""
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(part) for part in version.split(".")[:2]) < (0, 11)


QUICK_COMPILE = (
    # LLVM's optimization passes: most of a small program's compilation
    "--xla_backend_optimization_level=0",
    # the older elemental emitters compile small fusions faster than the
    # fusion emitters; with one codegen split, about half the backend
    # compile time of a small TrainLoop
    *(["--xla_cpu_use_fusion_emitters=false"] if _has_elemental_emitters() else []),
    SERIAL_CODEGEN,
)
r"""XLA flags the default suite compiles with, for speed."""


def xla_flags(n_devices: int) -> str:
    """XLA_FLAGS for a worker process with `n_devices` CPU devices, keeping the
    suite's other flags (`QUICK_COMPILE`)."""
    kept = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={n_devices}"])


def default_xla_flags(n_devices: int) -> str:
    """As `xla_flags`, with XLA's default optimization level and emitters: of
    `QUICK_COMPILE` only `SERIAL_CODEGEN` is kept (the cadence rows hold
    with it; it is not the default, so a run with it is not exactly XLA's
    default compilation)."""
    quick = set(QUICK_COMPILE) - {SERIAL_CODEGEN}
    return " ".join(flag for flag in xla_flags(n_devices).split() if flag not in quick)
