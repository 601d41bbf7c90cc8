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
    r"""Prints each summary (or checkpoint): a table of its groups and metrics,
    or with `compact=True` one line.

    >>> log = SummaryLogger()
    >>> for checkpoint in loop:
    ...     _ = log(eval_loop(checkpoint))      # or log(checkpoint): its train statistics
    >>> print(render_line(eval_loop(checkpoint)))  # doctest: +ELLIPSIS
    Step 4: 1 step in ... s | train loss ... | eval accuracy ...

    The compact line shows the interval's speed and, of the "train" group,
    the loss, the loss function's metrics and the optimizer's
    hyperparameters (the table shows every statistic). Only process 0
    prints. Groups may be empty and metrics may appear later.
    """

    def __init__(self, stdout: bool = True, compact: bool = False) -> None:
        self._stdout, self._compact = stdout, compact

    def __call__(self, summary: Checkpoint) -> Checkpoint:
        r"""Prints the summary and returns what it was given, unchanged."""
        expect(summary, Checkpoint, "SummaryLogger")
        if self._stdout and is_main_process():
            shown = as_summary(summary)
            if self._compact:
                console().print(Text(render_line(shown)), soft_wrap=True)
            else:
                console().print(render_summary(shown))
        return summary


def _format_value(value: Any) -> str:
    r"""A metric's value in 5 significant digits, thousands grouped.

    >>> [_format_value(v) for v in (0.5, 2712.345, 123456.7, 1e-7, 3, "n/a")]
    ['0.5', '2,712.3', '1.2346e+05', '1e-07', '3', 'n/a']
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    text = f"{number:.5g}"
    if "e" not in text and abs(number) >= 1000:
        whole, _, fraction = text.partition(".")
        text = f"{int(whole):,}" + (f".{fraction}" if fraction else "")
    return text


def _title(summary: Summary) -> str:
    steps = summary.n_completed_steps
    return (
        f"Step {summary.step}: {steps} step{'s' if steps != 1 else ''} in "
        f"{summary.elapsed_time:.2f} s" + (" (preempted)" if summary.preempted else "")
    )


def render_line(summary: Summary) -> str:
    r"""A summary in one line: step and timing, then each group's metrics
    (of "train", the loss, the loss function's metrics and hyperparameters)."""
    parts = [_title(summary)]
    for group, metrics in summary.metrics.items():
        if group == "train" and summary.train_metrics:
            metrics = {
                name: metrics.get(name, value) for name, value in summary.train_metrics.items()
            }
        shown = " ".join(f"{name} {_format_value(value)}" for name, value in metrics.items())
        parts.append(f"{group} {shown or '-'}")
    return " | ".join(parts)


def render_summary(summary: Summary) -> Table:
    r"""A rich table of a summary's metrics, titled with its step and timing."""
    table = Table(title=_title(summary), title_justify="left", show_edge=False, pad_edge=False)
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
