r"""The training state handed to the caller, and the same with metrics.

A `Checkpoint` is the saved state (`SavedState`'s fields) plus what the
loop measured over the interval that ended at it.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flax_loop.checkpoint._saved import Saved
from flax_loop.errors import ConfigError

Metrics = Mapping[str, Any]
r"""Metric values by name, e.g. `{"accuracy": 0.97}`."""


@dataclass
class Checkpoint(Saved):
    r"""The training state at a step, as a `TrainLoop` yields it.

    Arrays are global JAX arrays without a device axis: use them as they are
    (`model.apply({"params": checkpoint.model_params}, x)`). They are copies,
    so they stay valid after the loop moves on.

    >>> import jax
    >>> import optax
    >>> import numpy as np
    >>> import flax.linen as nn
    >>> from flax_loop import TrainLoop, TrainTask
    >>> model = nn.Dense(3)
    >>> def cross_entropy(logits, labels):
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    >>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
    >>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0), n_steps=4,
    ...                  n_steps_per_checkpoint=3, stdout=False)
    >>> for checkpoint in loop:
    ...     print(checkpoint.step, checkpoint.n_completed_steps, checkpoint.mean_loss > 0)
    3 3 True
    4 1 True
    """

    grads: Any
    r"""gradients of the last step, averaged over the devices."""

    loss: Any
    r"""the loss of the last step, averaged over the devices (a float)."""

    n_completed_steps: int
    r"""a number of steps completed between the previous checkpoint and this one."""

    elapsed_time: float
    r"""seconds of completed device work for those steps (compilation excluded)."""

    step: int
    r"""the step number at which this checkpoint occurred."""

    mean_loss: Any = field(default=None, kw_only=True)
    r"""the mean loss over the interval's steps, non-finite losses left out (a
    float; NaN if every step's loss was non-finite)."""

    n_nonfinite_steps: int = field(default=0, kw_only=True)
    r"""steps of the interval whose loss or gradient was not finite."""

    train_metrics: dict[str, float] = field(default_factory=dict, kw_only=True)
    r"""the interval's means on the devices of `loss` and of the metrics the
    loss function returns with it (`loss -> (loss, {"accuracy": ...})`), as
    floats; the logger and TensorBoard show them in the "train" group."""

    losses: Any = field(default=None, kw_only=True, repr=False)
    r"""every step's loss in the interval, a float32 numpy array of
    `n_completed_steps` (kept on the devices while training and read once
    here); `None` for a checkpoint not made by a loop."""

    preempted: bool = field(default=False, kw_only=True)
    r"""whether the loop stopped here because the process was asked to stop."""

    time_breakdown: dict[str, float] = field(default_factory=dict, kw_only=True)
    r"""where the interval's wall time went, in seconds: `compile`, `data`
    (waiting for batches), `device` (the devices' steps), `caller` (your
    code since the previous checkpoint) and `wall`, their sum; `device /
    wall` is the goodput (`flax_loop.timing`). `{}` for a checkpoint not
    made by a loop."""

    frozen: Any = field(default=None, kw_only=True, repr=False)
    r"""which parameters no optimizer trains (`TrainTask(trainable=...)`): a
    tree of booleans shaped as `model_params`, `True` for a frozen one;
    `None` when every parameter trains. `CheckpointFileWriter(save_frozen=False)`
    leaves those out of its files."""

    throughput: dict[str, float] = field(default_factory=dict, kw_only=True)
    r"""the interval's rates: `examples_per_second`; `tokens_per_second`
    when tokens are counted (`TrainTask(tokens=...)`, or integer inputs of
    shape (batch, length)); `flops_per_step` (XLA's count for the compiled
    step, over every device) and `flops_per_second_per_device` where the
    backend counts FLOPs; `mfu`, their fraction of the device's peak, where
    that is known (`TrainLoop.peak_flops`). `{}` for a checkpoint not
    made by a loop."""


@dataclass
class Summary(Checkpoint):
    r"""A checkpoint with metrics grouped by kind, e.g. `{"train": ..., "eval": ...}`.

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
    >>> checkpoint = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
    ...                       n_steps=2, stdout=False).next_checkpoint()
    >>> eval_loop = EvalLoop(EvalTask(model.apply, {"accuracy": accuracy}, test_batches),
    ...                      rnkey=jax.random.key(1), n_steps=None)
    >>> summary = eval_loop(checkpoint)
    >>> 0.0 <= summary.metrics["eval"]["accuracy"] <= 1.0
    True
    """

    metrics: Mapping[str, Metrics]
    r"""metric groups (such as "train" and "eval") mapping names to values."""


def expect(value: Any, kind: type[Checkpoint], who: str) -> None:
    r"""Raises a `ConfigError` unless `value` is a `kind`, naming who needed it.

    >>> import jax
    >>> import optax
    >>> import numpy as np
    >>> import flax.linen as nn
    >>> from flax_loop import TrainLoop, TrainTask
    >>> model = nn.Dense(3)
    >>> def cross_entropy(logits, labels):
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    >>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
    >>> checkpoint = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
    ...                       n_steps=2, stdout=False).next_checkpoint()
    >>> expect(checkpoint, Summary, "SummaryWriter")
    Traceback (most recent call last):
    ...
    flax_loop.errors.ConfigError: SummaryWriter needs a Summary (with metrics), ...
    """
    if not isinstance(value, kind):
        wanted = (
            "a Summary (with metrics), such as EvalLoop returns"
            if kind is Summary
            else "a Checkpoint or a Summary"
        )
        raise ConfigError(f"{who} needs {wanted}; got {type(value).__name__}.")
