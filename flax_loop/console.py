r"""Console output through rich, printed by process 0 only."""

import math
from typing import TYPE_CHECKING, Any

import jax
from rich.console import Console

if TYPE_CHECKING:
    from rich.table import Table

    from flax_loop.checkpoint._checkpoint import Summary

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

_console: Console | None = None


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


class SummaryLogger:
    r"""Prints each summary as a compact table: step, time, groups and metrics.

    >>> process = redex.combinator.serial(eval_loop, SummaryLogger())
    >>> for checkpoint in loop:
    ...     process(checkpoint)

    Only process 0 prints. Groups may be empty and metrics may appear later.
    """

    def __init__(self, stdout: bool = True) -> None:
        self._stdout = stdout

    def __call__(self, summary: "Summary") -> "Summary":
        r"""Prints the summary and returns it unchanged."""
        from flax_loop.checkpoint._checkpoint import Summary, expect

        expect(summary, Summary, "SummaryLogger")
        if self._stdout and is_main_process():
            console().print(render_summary(summary))
        return summary


def _format_value(value: Any) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if number != 0 and (abs(number) >= 1e5 or abs(number) < 1e-3):
        return f"{number:.4e}"
    return f"{number:.6f}"


def render_summary(summary: "Summary") -> "Table":
    r"""A rich table of a summary's metrics, titled with its step and timing."""
    from rich.table import Table

    steps = summary.n_completed_steps
    title = (
        f"Step {summary.step}: {steps} step{'s' if steps != 1 else ''} in "
        f"{summary.elapsed_time:.2f} s" + (" (preempted)" if summary.preempted else "")
    )
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("group")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for group, metrics in summary.metrics.items():
        if not metrics:
            table.add_row(group, "-", "-")
            continue
        for index, (name, value) in enumerate(metrics.items()):
            table.add_row(group if index == 0 else "", name, _format_value(value))
    return table
