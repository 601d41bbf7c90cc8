r"""Summaries and the model's size on the console, through rich (process 0 only)."""

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from flax_loop.checkpoint import Checkpoint, Summary, as_summary, expect
from flax_loop.log import console, is_main_process


class SummaryLogger:
    r"""Prints each summary (or checkpoint) in one line, or with
    `verbose=True` a table of its groups and every statistic.

    >>> import jax
    >>> import optax
    >>> import numpy as np
    >>> import flax.linen as nn
    >>> from flax_loop import TrainLoop, TrainTask, EvalLoop, EvalTask
    >>> model = nn.Dense(3)
    >>> def cross_entropy(logits, labels):
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    >>> test_batches = batches[:2]
    >>> def accuracy(logits, labels):
    ...     return (logits.argmax(-1) == labels).mean()
    >>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
    >>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0), n_steps=4,
    ...                  n_steps_per_checkpoint=3, stdout=False)
    >>> eval_loop = EvalLoop(EvalTask(model.apply, {"accuracy": accuracy}, test_batches),
    ...                      rnkey=jax.random.key(1), n_steps=None)
    >>> log = SummaryLogger(stdout=False)  # here: the line below is what the example shows
    >>> for checkpoint in loop:
    ...     _ = log(eval_loop(checkpoint))      # or log(checkpoint): its train statistics
    >>> print(render_line(eval_loop(checkpoint)))  # doctest: +ELLIPSIS
    Step 4: 1 step in ... s | train loss ... | eval accuracy ...

    The line shows the interval's speed and, of the "train" group, the
    loss, the loss function's metrics and the optimizer's hyperparameters;
    the table (`verbose=True`) shows every statistic (gradient norms,
    throughput, goodput, ...). Only process 0 prints. Groups may be empty
    and metrics may appear later.

    Args:
        stdout: whether to print at all.
        compact: one line a summary (the default); `False` is `verbose=True`.
        verbose: a table of every statistic instead of the line.
    """

    def __init__(self, stdout: bool = True, compact: bool = True, verbose: bool = False) -> None:
        self._stdout, self._compact = stdout, compact and not verbose

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
    compiling = float(getattr(summary, "time_breakdown", {}).get("compile", 0.0))
    notes = [f"{compiling:.2f} s of it compiling"] if compiling >= 0.01 else []
    notes += ["preempted"] if summary.preempted else []
    return (
        f"Step {summary.step:,}: {steps:,} step{'s' if steps != 1 else ''} in "
        f"{summary.elapsed_time:.2f} s" + (f" ({', '.join(notes)})" if notes else "")
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


def render_summary(summary: Summary) -> Group:
    r"""A line with the summary's step and timing, then a rich table of its
    metrics. (The line is not the table's title: rich pads a title to the
    table's width, leaving trailing spaces in a log file.)"""
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("group")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for group, metrics in summary.metrics.items():
        if not metrics:
            table.add_row(Text(group), "-", "-")
            continue
        for index, (name, value) in enumerate(metrics.items()):
            table.add_row(Text(group if index == 0 else ""), Text(name), _format_value(value))
    return Group(Text(_title(summary)), table)
