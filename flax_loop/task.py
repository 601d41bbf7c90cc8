r"""Descriptions of what to train and how to evaluate: data, never behaviour."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import optax

from flax_loop.batch import DataStream
from flax_loop.errors import ConfigError

MetricFn = Callable[..., Any]


@dataclass
class TrainTask:
    r"""The training task describes how to train a model.

    >>> task = TrainTask(apply=model.apply, optimizer=optax.adam(1e-3),
    ...                  loss=cross_entropy, data=batches)
    >>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
    ...                  n_steps=100, stdout=False)
    """

    apply: Callable[..., Any]
    r"""an apply function of the model (a linen module's `apply`), or an
    `nnx.Module`, called as `model(*inputs)` in training mode."""

    optimizer: optax.GradientTransformation
    r"""an optax optimizer."""

    loss: Callable[..., Any]
    r"""a loss function, called as `loss(*outputs, *targets)`; returns a scalar."""

    data: DataStream
    r"""an iterator or iterable of batches.

    A batch holds inputs and targets, each one array or several, in one of
    the forms `(x, y)`, `((x, ...), (y, ...))` or `((x, ...), ())`, as tuples
    or lists. Inputs are passed as `apply(variables, *inputs)`; the model's
    outputs `(o, ...)` and the targets as `loss(o, ..., y, ...)`.
    """


@dataclass
class EvalTask:
    r"""The evaluation task describes how to evaluate a model.

    >>> task = EvalTask(apply=model.apply, data=test_batches,
    ...                 metrics={"accuracy": accuracy, "loss": cross_entropy})
    >>> summary = EvalLoop(task, rnkey=jax.random.key(1), n_steps=None)(checkpoint)
    >>> sorted(summary.metrics["eval"])
    ['accuracy', 'loss']
    """

    apply: Callable[..., Any]
    r"""an apply function of the model (a linen module's `apply`), or an
    `nnx.Module`, called as `model(*inputs)` in evaluation mode."""

    metrics: Mapping[str, MetricFn]
    r"""metrics by name, each `fn(*outputs, *targets)` returning a value per
    example (an array with a leading batch axis) or the batch's mean."""

    data: DataStream
    r"""an iterable of evaluation batches, in the forms `TrainTask.data` takes.

    For whole passes (`EvalLoop(n_steps=None)`), give something that can be
    iterated again: a list, or a function returning a fresh iterator.
    """


def check_train_task(task: Any) -> TrainTask:
    r"""`task` if it describes training (duck-typed, as flax-extra's was).

    Raises:
        ConfigError: naming what is missing or of the wrong kind.
    """
    missing = [name for name in ("apply", "optimizer", "loss", "data") if not hasattr(task, name)]
    if missing:
        raise ConfigError(
            f"task must be a TrainTask(apply, optimizer, loss, data); got "
            f"{type(task).__name__} without {', '.join(missing)}."
        )
    for name in ("apply", "loss"):
        if not callable(getattr(task, name)):
            raise ConfigError(f"task.{name} must be callable; got {getattr(task, name)!r}.")
    optimizer = task.optimizer
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise ConfigError(
            f"task.optimizer must be an optax.GradientTransformation (with init "
            f"and update), such as optax.adam(1e-3); got {optimizer!r} of type "
            f"{type(optimizer).__name__}."
        )
    return task
