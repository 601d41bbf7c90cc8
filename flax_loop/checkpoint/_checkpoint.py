r"""`SavedState`: the one record of what a checkpoint saves, and its forms.

The state a run resumes from is declared once, here: the arrays (parameters,
the model's other collections, the optimizer's state, the moving average of
the parameters) and what places the run in its streams (the step, the run's
key, the data iterator's state). Every form of it is this record plus its
own extras: a `Checkpoint` adds the interval's statistics, a
`CheckpointFile` its metrics, format version and path. They convert into
each other by the record's field names, never field by field:

>>> import jax
>>> import numpy as np
>>> from flax_loop.checkpoint import CheckpointFile, SavedState
>>> saved = SavedState({"w": np.ones(2)}, {}, (), 7)
>>> file = CheckpointFile.from_saved(saved, metrics={"eval": {"accuracy": 0.9}})
>>> file.step, file.metrics["eval"]["accuracy"], file.saved_state() is not saved
(7, 0.9, True)
>>> halved = saved.map_arrays(lambda arrays: jax.tree.map(lambda a: a / 2, arrays))
>>> halved.model_params["w"], halved.step
(array([0.5, 0.5]), 7)

A field the step carries besides the parameters, the model state and the
optimizer state is declared by the step (`flax_loop.step.Step.fields`) and
travels in `carried` by its name: every form, file and reader follows from
the names. The
run's key is stored as its implementation's name and raw data
(`flax_loop.checkpoint.format.key_data`), in files and Orbax items alike.
"""

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import jax

from flax_loop.checkpoint._arriving import (
    STATISTICS,
    Statistic,
    own_attributes,
    settle,
)
from flax_loop.checkpoint._names import FORMAT_VERSION, LeftOut
from flax_loop.errors import CheckpointMismatchError, ConfigError

Metrics = Mapping[str, Any]
r"""Metric values by name, e.g. `{"accuracy": 0.97}`."""

_Form = TypeVar("_Form", bound="Saved")


HELD_AS_SAVED = ("carry",)
r"""Carried fields a run resumes only from a file that holds them, and a
file that holds them only into a run that carries them: the task's carry
(`TrainTask(carry=...)`) is part of what the step computes, so starting it
afresh mid-run, or dropping it, would silently change the run (a moving
average, by contrast, may start at a resume)."""


def check_held_as_saved(stored: set[str], wanted: set[str], where: str) -> None:
    r"""A `CheckpointMismatchError` when `HELD_AS_SAVED` fields differ
    between a file's carried fields (`stored`) and a run's (`wanted`)."""
    for name in HELD_AS_SAVED:
        if (name in stored) == (name in wanted):
            continue
        has, lacks = ("the file", "this task") if name in stored else ("this task", "the file")
        raise CheckpointMismatchError(
            f"{where}: {has} carries {name!r} (TrainTask({name}=...)) and {lacks} does "
            f"not; a run resumed so would start or drop it silently. Resume with the "
            f"task that wrote the file, or start a new directory."
        )


@dataclass
class Saved:
    r"""The fields every form of the saved state has (the record's, but the step)."""

    CORE: ClassVar[tuple[str, ...]] = ("model_params", "model_state", "optimizer_state")
    r"""the array fields every saved state has; the step declares any others
    (`carried`)."""

    model_params: Any
    r"""parameters of the model at the checkpoint."""

    model_state: Any
    r"""the model's other collections at the checkpoint (e.g. `batch_stats`)."""

    optimizer_state: Any
    r"""a state of the optimizer at the checkpoint."""

    carried: dict[str, Any] = field(default_factory=dict, kw_only=True, repr=False)
    r"""the other arrays the step carries from step to step, by the names it
    declares them under (`flax_loop.step.Step.fields`): the moving average
    of the parameters as `ema_params` with `TrainLoop(ema_decay=...)`.
    Saved, restored and laid out as the three fields above."""

    rnkey: jax.Array | None = field(default=None, kw_only=True, repr=False)
    r"""the run's key, kept so that a resumed run draws the same random numbers."""

    data_state: Any = field(default=None, kw_only=True, repr=False)
    r"""the data iterator's `get_state()` at this step, when it has one
    (restored with `set_state` on resume)."""

    caller_state: Any = field(default=None, kw_only=True, repr=False)
    r"""the loop body's own small state, `TrainLoop.caller_state`, as it is
    when the file is written (plain numbers, strings, lists and dicts, such
    as a plateau's best loss and patience); given back on resume."""

    optimizer_names: tuple[str, ...] | None = field(default=None, kw_only=True, repr=False)
    r"""with a dict of optimizers, their names in the order each step runs
    them (a run resumed with another order is refused); `None` with one."""

    @property
    def ema_params(self) -> Any:
        r"""the exponential moving average of the parameters, with
        `TrainLoop(ema_decay=...)`; `None` without."""
        return self.carried.get("ema_params")

    @property
    def carry(self) -> Any:
        r"""the arrays the step carries (`TrainTask(carry=...)`) as the step
        left them; `None` without."""
        return self.carried.get("carry")

    def saved_state(self) -> "SavedState":
        r"""The record of what this holds that a run resumes from."""
        return SavedState(**{name: getattr(self, name) for name in SAVED_FIELDS})

    @classmethod
    def from_saved(cls: type[_Form], saved: "Saved", **extras: Any) -> _Form:
        r"""This form of `saved` (any form), with its own `extras`."""
        return cls(**{name: getattr(saved, name) for name in SAVED_FIELDS}, **extras)

    def arrays(self) -> dict[str, Any]:
        r"""`{name: tree}` of every array field: `CORE`, then `carried`."""
        return {**{name: getattr(self, name) for name in self.CORE}, **self.carried}

    def with_arrays(self: _Form, arrays: Mapping[str, Any]) -> _Form:
        r"""A copy holding `arrays` (`{name: tree}`, as `arrays()` gives them):
        `CORE` names replace those fields, the others are the new `carried`."""
        core = {name: arrays[name] for name in self.CORE if name in arrays}
        carried = {name: tree for name, tree in arrays.items() if name not in self.CORE}
        return dataclasses.replace(self, **core, carried=carried)

    def take_arrays(self, arrays: Mapping[str, Any]) -> None:
        r"""Holds `arrays` (`{name: tree}`, as `arrays()` gives them) from now
        on, in place: the loop's change of the state the caller's body holds
        (`TrainLoop.update_state` at this checkpoint's step)."""
        for name in self.CORE:
            if name in arrays:
                setattr(self, name, arrays[name])
        self.carried = {name: tree for name, tree in arrays.items() if name not in self.CORE}

    def map_arrays(self: _Form, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> _Form:
        r"""A copy whose array fields are `fn(self.arrays())` (one call over
        all of them: one host transfer, one compiled program); the other
        fields are kept as they are."""
        return self.with_arrays(fn(self.arrays()))


@dataclass
class SavedState(Saved):
    r"""What a checkpoint saves and a run resumes from (see the module's doc)."""

    step: int
    r"""the number of steps trained."""


SAVED_FIELDS: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(SavedState))
r"""The names of the record's fields."""


@dataclass
class CheckpointFile(Saved):
    r"""What a checkpoint file holds: the saved state and its metrics.

    >>> import jax
    >>> import numpy as np
    >>> import optax
    >>> import flax.linen as nn
    >>> from flax_loop import CheckpointFileReader, CheckpointFileWriter, TrainLoop, TrainTask
    >>> import os, tempfile
    >>> directory = tempfile.mkdtemp()
    >>> model = nn.Dense(3)
    >>> def cross_entropy(logits, labels):
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    >>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
    >>> checkpoint = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
    ...                       n_steps=2, stdout=False).next_checkpoint()
    >>> _ = CheckpointFileWriter(output_dir=directory)(checkpoint)
    >>> file = CheckpointFileReader(dir=directory, target=model.init).read_newest()
    >>> file.step, os.path.basename(file.path), file.metrics
    (1, 'regular.1.ckpt', {})
    >>> jax.tree.all(jax.tree.map(np.array_equal, file.model_params, checkpoint.model_params))
    True
    """

    step: int
    r"""the step number at which this checkpoint occurred."""

    metrics: Metrics = field(default_factory=dict)
    r"""metrics at the checkpoint, by group (empty for a plain checkpoint)."""

    version: int = FORMAT_VERSION
    r"""the file format version."""

    path: str | None = field(default=None, compare=False)
    r"""the file it was read from (`None` for one not read from a file)."""

    left_out: LeftOut | None = field(default=None, kw_only=True)
    r"""the frozen parameters this file leaves out (`CheckpointFileWriter(
    save_frozen=False)`): their paths and a digest of their values, which a
    resumed run takes from its initialization and checks; `None` when the
    file holds every parameter."""


@dataclass
class Checkpoint(Saved):
    r"""The training state at a step, as a `TrainLoop` yields it.

    Arrays are global JAX arrays without a device axis: use them as they are
    (`model.apply({"params": checkpoint.model_params}, x)`). They are copies,
    so they stay valid after the loop moves on, and writing to them changes
    nothing the loop trains: `TrainLoop.update_state` and
    `TrainLoop.set_hyperparams` change the state the next step takes.

    A `for` loop may hand a checkpoint out while the devices still compute
    its interval's last steps (in one process): its
    statistics (`STATISTICS`) are filled in the first time one is read,
    waiting for the devices then; a non-finite interval raises
    `NonFiniteError` at that read and when a writer is given it.

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
    r"""where the interval's wall time went, in seconds; `compile`, `data`
    (waiting for batches), `device` (the devices' steps), `caller` (your
    code since the previous checkpoint) and `wall`, their sum; `device /
    wall` is the goodput (`flax_loop.run.throughput`). `{}` for a checkpoint not
    made by a loop."""

    mirrors_params: tuple[str, ...] = field(default=(), kw_only=True, repr=False)
    r"""the `carried` fields shaped as the parameters whose frozen entries are
    the parameters' (a moving average): a file that leaves the frozen
    parameters out leaves theirs out too."""

    frozen: Any = field(default=None, kw_only=True, repr=False)
    r"""which parameters no optimizer trains (`TrainTask(trainable=...)`); a
    tree of booleans shaped as `model_params`, `True` for a frozen one;
    `None` when every parameter trains. `CheckpointFileWriter(save_frozen=False)`
    leaves those out of its files."""

    throughput: dict[str, float] = field(default_factory=dict, kw_only=True)
    r"""the interval's rates, `examples_per_second`; `tokens_per_second`
    when tokens are counted (`TrainTask(tokens=...)`, or integer inputs of
    shape (batch, length)); `flops_per_step` (XLA's count for the compiled
    step, over every device; XLA counts the body of a loop once, so for a
    model that loops, in `lax.scan` or `fori_loop`, it is a lower bound)
    and `flops_per_second_per_device` where the backend counts FLOPs;
    `mfu`, their fraction of the device's peak, where that is known
    (`TrainLoop.peak_flops`). `{}` for a checkpoint not made by a loop."""

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        r"""Its attributes, its statistics settled first (`settle`), so that
        `Summary(**vars(checkpoint), metrics=...)` copies its numbers."""
        settle(self)
        return own_attributes(self)


for _name in STATISTICS:  # after the dataclass took the fields' defaults
    setattr(Checkpoint, _name, Statistic(_name))


def record(checkpoint: Checkpoint) -> dict[str, Any]:
    r"""`checkpoint`'s fields by name (its statistics settled)."""
    return {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(checkpoint)}


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
