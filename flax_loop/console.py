r"""Summaries and the model's size on the console, through rich (process 0 only)."""

from typing import Any

import jax
from rich.table import Table
from rich.text import Text

from flax_loop.checkpoint import Checkpoint, Summary, as_summary, expect
from flax_loop.log import console, format_bytes, is_main_process


def count_parameters(params: Any) -> tuple[int, int]:
    r"""The number of scalars in a pytree of arrays and their total bytes.

    >>> count_parameters({"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)})
    (8, 32)
    """
    leaves = jax.tree.leaves(params)
    return (
        sum(int(leaf.size) for leaf in leaves),
        sum(int(leaf.size) * leaf.dtype.itemsize for leaf in leaves),
    )


def describe_model(params: Any, n_devices: int, setup_seconds: float, trained: Any = None) -> str:
    r"""One line on the model's size and the loop's set-up time; with
    `trained` (the parameters that train, frozen ones `None`) how many train.

    >>> describe_model({"w": np.zeros((256, 4), np.float32)}, 4, 1.5)
    '1,024 parameters (4.0 KiB) on 4 devices; set-up 1.50 s'
    >>> describe_model({"w": np.zeros(8), "b": np.zeros(2)}, 1, 0.5, {"w": None, "b": np.zeros(2)})
    '10 parameters (80 B), 2 of 10 train, on 1 device; set-up 0.50 s'
    """
    n_params, n_bytes = count_parameters(params)
    devices = "1 device" if n_devices == 1 else f"{n_devices} devices"
    training = ""
    if trained is not None:
        n_trained, _ = count_parameters(trained)
        if n_trained != n_params:
            training = f", {n_trained:,} of {n_params:,} train,"
    return (
        f"{n_params:,} parameters ({format_bytes(n_bytes)}){training} "
        f"on {devices}; set-up {setup_seconds:.2f} s"
    )


class SummaryLogger:
    r"""Prints each summary (or checkpoint) as a table: step, time, groups and metrics.

    >>> log = SummaryLogger()
    >>> for checkpoint in loop:
    ...     _ = log(eval_loop(checkpoint))      # or log(checkpoint): its train statistics

    Only process 0 prints. Groups may be empty and metrics may appear later.
    """

    def __init__(self, stdout: bool = True) -> None:
        self._stdout = stdout

    def __call__(self, summary: Checkpoint) -> Checkpoint:
        r"""Prints the summary and returns what it was given, unchanged."""
        expect(summary, Checkpoint, "SummaryLogger")
        if self._stdout and is_main_process():
            console().print(render_summary(as_summary(summary)))
        return summary


def _format_value(value: Any) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if number != 0 and (abs(number) >= 1e5 or abs(number) < 1e-3):
        return f"{number:.4e}"
    return f"{number:.6f}"


def render_summary(summary: Summary) -> Table:
    r"""A rich table of a summary's metrics, titled with its step and timing."""
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
            table.add_row(Text(group), "-", "-")
            continue
        for index, (name, value) in enumerate(metrics.items()):
            table.add_row(Text(group if index == 0 else ""), Text(name), _format_value(value))
    return table
