r"""A step as a value: the fields it carries, `init` and `update`.

In the manner of an optax `GradientTransformation`, a `Step` is a pair of
pure functions and the names of what it carries:

- `init(fields) -> fields`: from the fields every run has (`CORE`: the
  parameters, the model's other collections, the optimizer state) to those
  plus the step's own, each under the name it declares (`Step.fields`);
- `update(fields, batch, context) -> (fields, Outcome)`: one step, the same
  fields in, the same structure, dtypes and shapes out.

A transform takes a step and returns one (`flax_loop.step.ema.with_ema`,
`flax_loop.step.nonfinite.skip_nonfinite`); `chain` applies several in
turn. The loop's machinery (placement, packing, the variants, intervals,
checkpoints, files, Orbax, the memory plan) reads the fields by name, so a
field is declared once, by the step that carries it:

>>> import jax.numpy as jnp
>>> def count_steps(step):
...     def init(fields):
...         return {**step.init(fields), "n_updates": jnp.zeros((), jnp.int32)}
...     def update(fields, batch, context):
...         fields, outcome = step.update(fields, batch, context)
...         return {**fields, "n_updates": fields["n_updates"] + 1}, outcome
...     return Step(init, update, {**step.fields, "n_updates": Field()})
>>> def constant(fields, batch, context):
...     return fields, Outcome(jnp.float32(0.5), {}, {}, jnp.asarray(True))
>>> counted = chain(Step(lambda fields: dict(fields), constant), count_steps)
>>> fields = counted.init({"model_params": {}, "model_state": {}, "optimizer_state": ()})
>>> fields, outcome = counted.update(fields, None, Context(None, jnp.int32(0)))
>>> int(fields["n_updates"]), float(outcome.loss), sorted(counted.fields)
(1, 0.5, ['n_updates'])
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax

from flax_loop.errors import ConfigError

CORE = ("model_params", "model_state", "optimizer_state")
r"""The fields every step carries (`flax_loop.checkpoint.Saved.CORE`)."""

Fields = dict[str, Any]
r"""A step's carried fields by name; `CORE`, then the step's own."""


class Field(NamedTuple):
    r"""How the machinery treats a field a step declares."""

    mirrors_params: bool = False
    r"""whether it is shaped as the parameters, a frozen parameter's entry
    being the parameter itself (a moving average): it is laid out as the
    parameters, and a file that leaves the frozen parameters out leaves its
    entries for them out too. Otherwise it is replicated."""

    rows_of_batch: bool = False
    r"""whether a leaf with a row per example of the batch (its leading size
    is the batch's) is laid out split with the batch, each device holding
    its examples' rows (a carry); its other leaves are replicated."""


class Context(NamedTuple):
    r"""What a step's `update` takes besides its fields and the batch."""

    key: Any
    r"""the run's training key (replicated); `flax_loop.random` derives the
    step's and the device's keys from it."""

    step: jax.Array
    r"""the number of updates done before this one (0 at the first), int32."""

    frozen: Any = None
    r"""the frozen models of `TrainTask(frozen=...)`, or `None`. Their arrays
    as the program takes them; the models themselves inside `with_frozen`."""

    whole: Callable[[Any], Any] | None = None
    r"""the parameters to bind the model with, as a function of those the
    step differentiates (`train_only` puts the frozen ones back), or `None`
    when they are the same."""


class Outcome(NamedTuple):
    r"""What one step reports besides its new fields."""

    loss: jax.Array
    r"""the step's loss, a scalar averaged over the devices."""

    metrics: dict[str, jax.Array]
    r"""the step's training metrics by name, scalars averaged over the devices."""

    grads: Any
    r"""the step's gradients (a checkpoint shows the last step's)."""

    finite: jax.Array
    r"""whether the step counts as finite (its loss; with
    `skip_nonfinite`, its gradients too): the interval's statistics count
    the others as non-finite."""


Init = Callable[[Fields], Fields]
Update = Callable[[Fields, Any, Context], tuple[Fields, Outcome]]


class Step(NamedTuple):
    r"""A step: its `init`, its `update` and the fields it declares."""

    init: Init
    r"""`init(fields) -> fields`; `CORE` in, every field the step carries out."""

    update: Update
    r"""`update(fields, batch, context) -> (fields, Outcome)`, traced and compiled."""

    fields: Mapping[str, Field] = {}
    r"""the fields it carries besides `CORE`, by name."""


Transform = Callable[[Step], Step]
r"""A step's transform; `with_ema(decay)`-like functions of a step."""


def chain(step: Step, *transforms: Transform) -> Step:
    r"""`step` with each of `transforms` applied in turn (the last outermost)."""
    for transform in transforms:
        step = transform(step)
    return step


def declare(step: Step, name: str, field: Field) -> Mapping[str, Field]:
    r"""`step.fields` with `name` added.

    Raises:
        ConfigError: if `name` is taken (by `CORE` or by `step`).
    """
    if name in CORE or name in step.fields:
        raise ConfigError(
            f"A step already carries a field named {name!r} (its fields: "
            f"{[*CORE, *step.fields]}): declare the new one under another name."
        )
    return {**step.fields, name: field}
