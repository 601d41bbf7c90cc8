r"""Console output through rich, printed by process 0 only."""

import math
from typing import Any, Optional

import jax
from rich.console import Console

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

_console: Optional[Console] = None


def console() -> Console:
    r"""The shared rich console (created on first use, so tests can swap stdout)."""
    global _console
    if _console is None:
        _console = Console(highlight=False)
    return _console


def is_main_process() -> bool:
    r"""Whether this process prints, logs and writes files (process 0)."""
    return jax.process_index() == 0


def log(message: str, stdout: bool = True) -> None:
    r"""Prints a message on process 0 when `stdout` is set."""
    if stdout and is_main_process():
        console().print(message)


def format_bytes(size: int) -> str:
    r"""`1536` -> `"1.5 KiB"`."""
    if size < 1024:
        return f"{size} B"
    power = min(int(math.log(size, 1024)), len(_BYTE_UNITS) - 1)
    return f"{size / 1024**power:.1f} {_BYTE_UNITS[power]}"


def count_parameters(params: Any) -> tuple[int, int]:
    r"""The number of scalars in a pytree of arrays and their total bytes."""
    leaves = jax.tree.leaves(params)
    return (
        sum(int(leaf.size) for leaf in leaves),
        sum(int(leaf.size) * leaf.dtype.itemsize for leaf in leaves),
    )


def describe_model(params: Any, n_devices: int, setup_seconds: float) -> str:
    r"""One line on the model's size and the loop's set-up time."""
    n_params, n_bytes = count_parameters(params)
    devices = "1 device" if n_devices == 1 else f"{n_devices} devices"
    return (
        f"[bold]Model[/bold]: {n_params:,} parameters ({format_bytes(n_bytes)}) "
        f"on {devices}; set-up {setup_seconds:.2f} s"
    )
