r"""Skipping non-finite updates, as a transform of a step.

`skip_nonfinite()` keeps every carried field as it was (the parameters, the
model state, the optimizer state and any field a transform declared) when
the step's loss or a gradient is not finite; the step counts as non-finite
in the interval's statistics either way.

>>> import jax.numpy as jnp
>>> from flax_loop.step.core import Context, Outcome, Step
>>> def broken(fields, batch, context):
...     grads = {"w": jnp.array([jnp.nan])}
...     return {**fields, "model_params": {"w": jnp.zeros(1)}}, Outcome(
...         jnp.float32(1.0), {}, grads, jnp.asarray(True))
>>> step = skip_nonfinite()(Step(dict, broken))
>>> fields, outcome = step.update({"model_params": {"w": jnp.ones(1)}}, None,
...                               Context(None, jnp.int32(0)))
>>> fields["model_params"]["w"].tolist(), bool(outcome.finite)
([1.0], False)
"""

from typing import Any

import jax
import jax.numpy as jnp

from flax_loop.step.core import Context, Fields, Outcome, Step, Transform

MODES = ("raise", "skip")
r"""`TrainLoop(nonfinite=...)`; raise at the checkpoint, or skip such updates."""


def all_finite(tree: Any) -> jax.Array:
    r"""Whether every floating-point value of a pytree is finite.

    >>> bool(all_finite({"w": jnp.ones(3), "count": jnp.zeros((), jnp.int32)}))
    True
    >>> bool(all_finite([jnp.array([1.0, jnp.nan])]))
    False
    """
    leaves = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def skip_nonfinite() -> Transform:
    r"""The transform leaving the fields as they were after a step whose loss
    or gradients are not finite (the state keeps its structure either way,
    so a file resumes in either mode)."""

    def transform(step: Step) -> Step:
        def update(carried: Fields, batch: Any, context: Context) -> tuple[Fields, Outcome]:
            new, outcome = step.update(carried, batch, context)
            finite = outcome.finite & all_finite(outcome.grads)
            kept = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, carried)
            return kept, outcome._replace(finite=finite)

        return Step(step.init, update, step.fields)

    return transform
