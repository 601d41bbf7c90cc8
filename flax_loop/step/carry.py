r"""Arrays a step carries for its losses (`TrainTask(carry=...)`), as a transform.

`with_carry(carry)` declares the field `carry` and starts it at the given
arrays, or at `carry(params)` for a function of the initial parameters (a
target network starting as the online one). The step it wraps reads the
field and returns it changed: a `compute_loss` takes it as `carry=` and
returns `(loss, metrics, new_carry)` (`split_carry`), a task's own step
holds it in `StepState.carry`. The carry is one global value: a leaf with
one row per example of the batch is the whole batch's rows, on any number
of devices, laid out split with the batch (each device holds its examples'
rows); its other leaves are replicated. Only the per-device
form (a step that names the batch axis) averages its floating-point leaves
over the devices after each step (`pmean_floating`).

>>> import jax.numpy as jnp
>>> from flax_loop.step.core import Context, Outcome, Step
>>> def count(fields, batch, context):
...     new = {**fields, CARRY: {"seen": fields[CARRY]["seen"] + 1}}
...     return new, Outcome(jnp.float32(0), {}, {}, True)
>>> step = with_carry({"seen": jnp.int32(0)})(Step(dict, count))
>>> fields = step.init({"model_params": {}, "model_state": {}, "optimizer_state": ()})
>>> fields, _ = step.update(fields, None, Context(None, jnp.int32(0)))
>>> int(fields[CARRY]["seen"]), sorted(step.fields)
(1, ['carry'])
"""

from typing import Any

import jax
import jax.numpy as jnp

from flax_loop.errors import ConfigError, LossError
from flax_loop.step.core import Field, Fields, Step, Transform, declare

CARRY = "carry"
r"""The field a task's `carry` is carried (and saved) as."""


def with_carry(carry: Any) -> Transform:
    r"""The transform declaring the `CARRY` field, started at `carry` (arrays,
    or a function of the initial parameters returning them)."""

    def transform(step: Step) -> Step:
        fields = declare(step, CARRY, Field(rows_of_batch=True))

        def init(given: Fields) -> Fields:
            inner = step.init(given)
            value = carry(inner["model_params"]) if callable(carry) else carry
            _refuse_typed_keys(value)
            # copies: a carried array never shares a buffer with another field
            return {**inner, CARRY: jax.tree.map(jnp.array, value)}

        return Step(init, step.update, fields)

    return transform


def _refuse_typed_keys(carry: Any) -> None:
    r"""A `ConfigError` naming a typed key (`jax.random.key`) in the carry:
    checkpoint files hold numbers, and a key's bits are its data."""
    flat, _ = jax.tree_util.tree_flatten_with_path(carry)
    for path, leaf in flat:
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
            name = "carry" + jax.tree_util.keystr(path)
            raise ConfigError(
                f"{name} is a typed key ({leaf.dtype}): checkpoint files hold numbers, "
                f"so carry its data, jax.random.key_data(key), and make the key again "
                f"in the step with jax.random.wrap_key_data(...); or draw from the "
                f"step's own rng, which the loop derives from the step (the same on "
                f"resume)."
            )


def split_carry(result: Any, name: str | None) -> tuple[Any, Any]:
    r"""A carrying loss's `(loss, metrics, new_carry)` as `((loss, metrics),
    new_carry)`, or a `LossError` naming what it returned."""
    if isinstance(result, tuple) and len(result) == 3:
        return (result[0], result[1]), result[2]
    where = "task.compute_loss" + ("" if name is None else f"[{name!r}]")
    got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
    raise LossError(
        f"With task.carry, {where} returns (loss, metrics, new_carry): the carry it was "
        f"given changed or as it was ({{}} for no metrics); it returned {got}."
    )


def pmean_floating(tree: Any, axis_name: str) -> Any:
    r"""Averages floating-point leaves over the axis; integer counters stay."""

    def average(leaf: jax.Array) -> jax.Array:
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            return jax.lax.pmean(leaf, axis_name)
        return leaf

    return jax.tree.map(average, tree)
