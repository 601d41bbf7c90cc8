r"""Descriptions of what to train and how to evaluate: data, never behaviour."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optax

from flax_loop.data.batch import DataStream
from flax_loop.errors import ConfigError
from flax_loop.step.core import Transform
from flax_loop.step.model import check_compute_loss
from flax_loop.step.modules import is_nnx
from flax_loop.step.objective import LossFn
from flax_loop.step.own import check_update
from flax_loop.step.several import ModelKind, check_models, trains_by_model

MetricFn = Callable[..., Any]


@dataclass
class TrainTask:
    r"""The training task describes how to train a model.

    Fields (each documented in full below; `help()` and the API page show them):

    - `apply`: the model, a linen `apply` or an `nnx.Module`.
    - `optimizer`: an optax optimizer, or a dict of them by name.
    - `loss`: `loss(*outputs, *targets)`, for `(inputs, targets)` batches.
    - `data`: the batches: an iterator, or an iterable read epoch after epoch.
    - `compute_loss`: instead of `loss`, `compute_loss(model, batch, *, rng,
      step)` for batches of any structure (a dict by name with several
      optimizers).
    - `trainable`: which parameters train (all by default).
    - `frozen`: frozen models by name (a teacher), given to `compute_loss`.
    - `transforms`: transforms of the step, `transform(step) -> step`.
    - `tokens`, `examples`: `fn(batch) -> int`, the counts behind the
      throughput's tokens and examples per second.
    - `update`: your own step, `update(state, batch, *, rng, step) ->
      (state, metrics)`, instead of `loss` and `compute_loss`.
    - `carry`: arrays the step carries from step to step (saved, resumed).

    >>> import jax
    >>> import numpy as np
    >>> import flax.linen as nn
    >>> from flax_loop import TrainLoop
    >>> model = nn.Dense(3)
    >>> def cross_entropy(logits, labels):
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    >>> task = TrainTask(apply=model.apply, optimizer=optax.adam(1e-3),
    ...                  loss=cross_entropy, data=batches)
    >>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
    ...                  n_steps=100, stdout=False)
    """

    apply: Callable[..., Any]
    r"""an apply function of the model (a linen module's `apply`), or an
    `nnx.Module`, called as `model(*inputs)` in training mode."""

    optimizer: optax.GradientTransformation
    r"""an optax optimizer. One that reads more than the gradients gets
    optax's extra arguments: the step's loss as `value`, its gradient as
    `grad`, the loss as a function of the parameters as `value_fn`
    (`optax.contrib.reduce_on_plateau`, `optax.polyak_sgd`, `optax.lbfgs`)."""

    loss: Callable[..., Any] | None = None
    r"""a loss function, called as `loss(*outputs, *targets)`; returns a
    scalar, or `(scalar, {name: scalar})` to report training metrics.
    Give it or `compute_loss`."""

    data: DataStream = None  # type: ignore[assignment]
    r"""an iterator or iterable of batches.

    With `loss`, a batch holds inputs and targets, each one array or
    several, in one of the forms `(x, y)`, `((x, ...), (y, ...))` or
    `((x, ...), ())`, as tuples or lists. Inputs are passed as
    `apply(variables, *inputs)`; the model's outputs `(o, ...)` and the
    targets as `loss(o, ..., y, ...)`. With `compute_loss`, a batch is any
    pytree of arrays with a leading batch axis (a dict works), given to it
    as the stream gave it.
    """

    compute_loss: LossFn | Mapping[str, LossFn] | None = None
    r"""instead of `loss`; `compute_loss(model, batch, *, rng, step)`
    returning a scalar loss or `(loss, {name: scalar})`.

    `model` is the model in training mode holding the step's variables: an
    NNX module, or for linen a callable, `model(*inputs, **kwargs)` applying
    them (`method=` and any other keyword pass through; collections such as
    `batch_stats` change and carry over as in training). It may be called
    several times (each call draws its own dropout) and differentiated
    through. `batch` is the stream's whole batch, `rng` a key of this step,
    the same on any number of devices (`jax.random.normal(rng, ...)`), `step` the number of updates
    done before this one (a traced int, 0 at the first, as optax's `count`
    and Flax's `TrainState.step`). With `frozen`, it also takes `frozen`.

    Sown values reach the loss: linen's `self.sow("intermediates", ...)`
    (or any collection the variables lack) fills `model.sown` after a call
    (`model.sown["intermediates"]`); for NNX, call the module through
    `nnx.capture(model, nnx.Intermediate)(x)`, which returns them. Sown
    values are never carried from step to step.

    A dict by name, with `optimizer` a dict of the same names: each step
    runs them in the dict's order, each differentiated with respect to its
    `trainable` parameters and applied with its optimizer, a later one
    seeing the parameters an earlier one updated (a GAN's discriminator,
    then its generator). The step's loss is their sum; each one's is the
    training metric `<name>_loss`."""

    trainable: Any = None
    r"""which parameters train (all with `None`); a filter `fn(path, leaf) ->
    bool` (`path` the keys to the leaf, such as `("Dense_0", "kernel")`), a
    key name, a list of filters, or for an NNX module any NNX filter (a
    `Variable` type such as `nnx.LoRAParam`, `nnx.PathContains(...)`).
    Frozen parameters get no gradient and no optimizer state and never
    change. With several optimizers, a dict of filters by their names."""

    frozen: Any = None
    r"""frozen models (a teacher) or pytrees, by name, such as
    `{"teacher": module}`. They live on the devices beside the state, never
    change and are not saved in checkpoints. `compute_loss` gets them as its
    keyword argument `frozen`: NNX modules in evaluation mode, anything else
    (a linen model's variables) as given. They are taken when the
    `TrainLoop` is made: changing a module afterwards changes nothing the
    loop computes (a new `TrainLoop` takes the change)."""

    transforms: Sequence[Transform] = ()
    r"""transforms of the task's step, applied in order after the task's
    own (its losses and optimizers), before the moving average and the
    skipping of non-finite steps: functions `transform(step) -> step` of a
    `flax_loop.step.Step`, as `optax.chain` composes transformations. A
    transform that carries a field of its own declares it
    (`Step.fields`): the loop places, saves, restores and counts it by that
    name (`Checkpoint.carried`)."""

    tokens: Any = None
    r"""`tokens(batch) -> int`; the tokens of a batch, for
    `Checkpoint.throughput`'s `tokens_per_second` (called once, on the first
    batch as the stream gave it); by default an integer input of shape
    (batch, length) counts as token ids."""

    update: Callable[..., Any] | None = None
    r"""instead of `loss` and `compute_loss`, your own step:
    `update(state, batch, *, rng, step) -> (state, metrics)`, traced and
    compiled by the loop, with every guarantee of the built-in steps
    (exact resume, the same bits for any cadence, N devices computing what
    one computes).

    `state` (`flax_loop.step.own.StepState`) holds `params`, `model_state`,
    `opt_state` (a dict by name when `optimizer` is a dict) and `carry`;
    `state.model(params)` is the model bound to `params`, as `compute_loss`
    gets it, to call and differentiate through; `state.apply_gradients(
    grads, name=None, **extra_args)` applies the named optimizer to its
    `trainable` parameters (the gradients of the whole batch; `value=loss`
    and optax's other extra arguments for an optimizer that reads them), as
    often as the step needs (in Python loops, `lax.scan`, `fori_loop`); `state.replace(...)`
    changes the rest. `batch` is the stream's whole batch as it gave it,
    `rng` a key of this step (the same on any number of devices), `step`
    the number of updates done before this one (0 at the first), as optax's `count` and Flax's
    `TrainState.step` count. `metrics` is a dict of scalars with `"loss"`
    (what the interval's mean, the non-finite check and the progress bar
    read). With `data=None` the step reads no data (`batch` is `None`: a
    rollout in the step) and the loop runs `n_steps` steps. The model
    state's and the carry's floating-point values are averaged over the
    devices after each step; return the state's
    `model_state` changed (`state.replace(model_state=...)`) for
    collections the model's calls change."""

    carry: Any = None
    r"""arrays (a pytree) the step carries from step to step; a loss scale,
    a target network, an environment's state; or a function of the initial
    parameters returning them (`carry=lambda params: {"target": params}`,
    called when training starts afresh, never on resume). `update` reads
    them as `state.carry` and returns them changed with `state.replace(
    carry=...)`; a `compute_loss` takes them as the keyword `carry` and
    returns `(loss, metrics, new_carry)`. They are returned in
    `Checkpoint.carry`, saved in files and Orbax checkpoints, restored on
    resume, shown by `flax-loop show` and counted by the memory plan; the
    step keeps their structure, dtypes and shapes. They are one value, as
    on one device, on any number of devices: a leaf with a row per example
    holds the whole batch's rows, never averaged."""

    examples: Any = None
    r"""`examples(batch) -> int`; the examples of a batch, for
    `Checkpoint.throughput`'s `examples_per_second` (called once, on the
    first batch as the stream gave it); by default its leading size (the
    smallest of its arrays', for a graph batch: its graphs)."""


@dataclass
class EvalTask:
    r"""The evaluation task describes how to evaluate a model.

    >>> import jax
    >>> import numpy as np
    >>> import flax.linen as nn
    >>> from flax_loop import TrainLoop, EvalLoop
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


def check_train_task(task: Any) -> tuple[TrainTask, ModelKind]:
    r"""`task` if it describes training (duck-typed, as flax-extra's was),
    and what its model is, settled here once for the whole set-up.

    Raises:
        ConfigError: naming what is missing or of the wrong kind.
    """
    _check_form(task)
    kind = ModelKind.of(task.apply)
    if kind.several:
        if getattr(task, "loss", None) is not None:
            raise ConfigError(
                f"task.apply is a dict of models {list(task.apply)}: a loss(*outputs, "
                "*targets) calls one model; give compute_loss(model, batch, *, rng, step) "
                "(model a dict by name) or update."
            )
        for name, model in task.apply.items():
            _check_model(model, f"task.apply[{name!r}]")
        check_models(task.apply, "task.apply")
    else:
        _check_model(task.apply, "task.apply")
    _check_optimizers(task, kind)
    transforms = getattr(task, "transforms", ())
    if not isinstance(transforms, Sequence) or not all(map(callable, transforms)):
        raise ConfigError(
            f"task.transforms must be a list of functions transform(step) -> step "
            f"(flax_loop.step.Transform); got {transforms!r}."
        )
    compute_loss = getattr(task, "compute_loss", None)
    if compute_loss is not None:
        losses = compute_loss if isinstance(compute_loss, Mapping) else {None: compute_loss}
        for name, fn in losses.items():
            where = "task.compute_loss" + ("" if name is None else f"[{name!r}]")
            check_compute_loss(
                fn,
                where,
                getattr(task, "frozen", None) is not None,
                getattr(task, "carry", None) is not None,
            )
    return task, kind


def _check_model(apply: Any, where: str) -> None:
    r"""One model: an apply function (not jitted) or an NNX module."""
    if _is_linen_module(apply):
        raise ConfigError(
            f"{where} is the linen module {type(apply).__name__}: pass its apply "
            "function, TrainTask(model.apply, ...), and its init, TrainLoop(init=model.init, "
            "...) (an NNX module goes as itself)."
        )
    if not (callable(apply) or is_nnx(apply)):
        raise ConfigError(f"{where} must be callable; got {apply!r}.")
    if hasattr(apply, "lower") and hasattr(apply, "trace"):  # jax.jit(model.apply)
        raise ConfigError(
            f"{where} is compiled with jax.jit: pass the un-jitted model.apply. "
            "flax_loop compiles the whole step itself (the model, the loss and the "
            "update as one program)."
        )


def _check_form(task: Any) -> None:
    r"""What the task has: its fields, and one of `loss`, `compute_loss` and
    `update` (with what goes with each)."""
    loss, compute_loss = getattr(task, "loss", None), getattr(task, "compute_loss", None)
    update = getattr(task, "update", None)
    # a step of your own may read no data: it then runs without a stream
    needed = ("apply", "optimizer") if update else ("apply", "optimizer", "data")
    missing = [name for name in needed if getattr(task, name, None) is None]
    if loss is None and compute_loss is None and update is None:
        missing.append("loss (or compute_loss, or update)")
    if missing:
        raise ConfigError(
            f"task must be a TrainTask(apply, optimizer, loss, data) (or with "
            f"compute_loss= instead of loss); got {type(task).__name__} without "
            f"{', '.join(missing)}."
        )
    forms = {"loss": loss, "compute_loss": compute_loss, "update": update}
    given = [name for name, value in forms.items() if value is not None]
    if len(given) > 1:
        raise ConfigError(
            f"task has {'both ' if len(given) == 2 else ''}{' and '.join(given)}; give one: "
            "loss(*outputs, *targets), "
            "compute_loss(model, batch, *, rng, step) for a loss that calls the model, "
            "or update(state, batch, *, rng, step) for a step of your own."
        )
    if getattr(task, "carry", None) is not None and update is None and compute_loss is None:
        raise ConfigError(
            "task.carry is carried by a step that reads it: pass compute_loss(model, "
            "batch, *, rng, step, carry) returning (loss, metrics, new_carry), or "
            "update(state, batch, *, rng, step), which reads and returns it as state.carry."
        )
    if update is not None:
        check_update(update)
    if loss is not None and not callable(loss):
        raise ConfigError(f"task.loss must be callable; got {loss!r}.")
    if getattr(task, "frozen", None) is not None and loss is not None:
        raise ConfigError(
            "task.frozen is given to compute_loss(..., frozen=...) (and to update as "
            "state.frozen); a task with loss(*outputs, *targets) cannot use it. Pass "
            "compute_loss instead of loss."
        )


def _check_optimizers(task: Any, kind: ModelKind) -> None:
    r"""The optimizer, or the dict of them with `compute_loss` and
    `trainable` dicts of the same names."""
    optimizers = task.optimizer if isinstance(task.optimizer, Mapping) else {None: task.optimizer}
    if not optimizers:
        raise ConfigError("task.optimizer is an empty dict; give at least one optimizer.")
    for name, optimizer in optimizers.items():
        where = "task.optimizer" + ("" if name is None else f"[{name!r}]")
        if not (
            callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))
        ):
            raise ConfigError(
                f"{where} must be an optax.GradientTransformation (with init "
                f"and update), such as optax.adam(1e-3); got {optimizer!r} of type "
                f"{type(optimizer).__name__}."
            )
    keyed = isinstance(task.optimizer, Mapping)
    names = list(optimizers)
    for field in ("compute_loss", "trainable"):
        value = getattr(task, field, None)
        if not isinstance(value, Mapping):
            continue
        if not keyed:
            raise ConfigError(
                f"task.{field} is a dict by name ({list(value)}); task.optimizer must then "
                f"be a dict of the same names (one optimizer each); got {task.optimizer!r}."
            )
        if list(value) != names:
            raise ConfigError(
                f"task.{field} names {list(value)} but task.optimizer names {names}: "
                "give both the same names, in the order each step runs them."
            )
    if keyed and not isinstance(getattr(task, "trainable", None), Mapping):
        if trains_by_model(task, kind):  # each optimizer trains the model of its name
            return
        # each optimizer would otherwise train (and keep moments for) every parameter
        raise ConfigError(
            f"task.optimizer is a dict of optimizers {names}: say which parameters each "
            f"trains with task.trainable, a dict of the same names, such as "
            f"{{{', '.join(f'{name!r}: {name!r}' for name in names)}}} (a key name, an "
            f"NNX filter or fn(path, leaf)); got trainable={getattr(task, 'trainable', None)!r}."
        )


def _is_linen_module(value: Any) -> bool:
    from flax import linen

    return isinstance(value, linen.Module)
