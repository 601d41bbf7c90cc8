r"""A step as the loop runs it: its fields in a `TrainState`, the interval counted.

`counted(step)` is the update every compiled variant runs: the step's own
update on the state's fields, the dtypes and shapes it must keep checked
while tracing, and the interval's statistics (the step count, the
non-finite steps and the first of them, the sums of the loss and the
metrics) advanced on the devices.

>>> import jax, jax.numpy as jnp
>>> from flax_loop.programs.state import TrainState
>>> from flax_loop.step.core import Outcome, Step
>>> def constant(fields, batch, context):
...     return fields, Outcome(jnp.float32(0.5), {"accuracy": jnp.float32(1)}, {}, True)
>>> update = counted(Step(dict, constant))
>>> state = TrainState.create({"model_params": {"w": jnp.ones(2)}}, step=0)
>>> state, (loss, grads) = update(state, None, jax.random.key(0))
>>> state, (loss, grads) = update(state, None, jax.random.key(0))
>>> state.counters.tolist(), float(state.loss_sum), float(state.metric_sums["accuracy"])
([2, 0, 0], 1.0, 2.0)
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.core.scope import CollectionFilter

from flax_loop.data.batch import Batch
from flax_loop.errors import ApplyError
from flax_loop.parallel import key_names
from flax_loop.programs.state import TrainState
from flax_loop.step.build import task_step
from flax_loop.step.core import Context, Step
from flax_loop.step.objective import Objective, Part, StepInputs
from flax_loop.step.supervised import supervised_loss

Update = Callable[[TrainState, Batch, Any], tuple[TrainState, tuple[jax.Array, Any]]]
r"""`update(state, batch, inputs) -> (state, (loss, grads))`; what the
compiled variants run (`flax_loop.programs.lowering`); `inputs` a `StepInputs`, or
without frozen models the training key alone."""


def check_kept(new: dict[str, Any], old: dict[str, Any]) -> None:
    r"""Raises an `ApplyError` (while tracing) naming each carried value whose
    structure, dtype or shape a step changed: the state keeps them from step
    to step, in every layout (a packed state would otherwise cast it
    silently)."""
    if list(new) != list(old):
        raise ApplyError(
            f"A step returned the fields {sorted(new)} for the fields {sorted(old)}: "
            "a step returns every field it was given, and no other."
        )
    for name in old:
        if jax.tree.structure(new[name]) != jax.tree.structure(old[name]):  # type: ignore[operator]
            raise ApplyError(
                f"A step changed the structure of {name}: {jax.tree.structure(old[name])} "
                f"became {jax.tree.structure(new[name])}. A field keeps its structure from "
                "step to step."
            )
        changed = [
            f"{'/'.join(key_names(path))}: {before.dtype}{list(before.shape)} -> "
            f"{after.dtype}{list(after.shape)}"
            for (path, before), after in zip(
                jax.tree_util.tree_flatten_with_path(old[name])[0], jax.tree.leaves(new[name])
            )
            if before.dtype != after.dtype or before.shape != after.shape
        ]
        if changed:
            raise ApplyError(
                f"A step changed the dtype or shape of {name} ({'; '.join(changed[:5])}"
                f"{'; ...' if len(changed) > 5 else ''}). A variable keeps its dtype and "
                "shape from step to step: cast the new value in the model "
                "(value.astype(old.dtype)), or create the variable with the dtype it takes."
            )


def counted(step: Step) -> Update:
    r"""The update the loop compiles: `step` on the state's fields, and the
    interval's counters and sums advanced.

    A step counts as non-finite when its `Outcome.finite` is false; its loss
    and metrics are then left out of the sums.

    Returns:
        `update(state, batch, inputs) -> (state, (loss, grads))`, one trace
        that every compiled variant inlines.
    """

    def stepped(fields: Any, batch: Batch, key: Any, done: jax.Array, frozen: Any) -> Any:
        return step.update(fields, batch, Context(key, done, frozen))

    # The step's own trace, kept by `jax.jit` for its arguments' shapes: the
    # state's metric sums, which the first lowering learns from this very
    # trace (`LayoutChanged`), change the update's arguments but not the
    # step's, so the model and the loss are traced once, not twice.
    stepped_once = jitted_when_traced(stepped)

    def update(state: TrainState, batch: Batch, inputs: Any) -> tuple[TrainState, Any]:
        key, frozen = inputs if isinstance(inputs, StepInputs) else (inputs, None)
        done, n_bad, first_bad = state.counters[0], state.counters[1], state.counters[2]
        fields, outcome = stepped_once(state.fields, batch, key, done, frozen)
        check_kept(fields, state.fields)
        finite = jnp.asarray(outcome.finite)
        number = done + 1
        bad = (~finite).astype(jnp.int32)
        counters = jnp.stack(
            [number, n_bad + bad, jnp.where((first_bad == 0) & (bad == 1), number, first_bad)]
        )
        new_state = TrainState(
            counters=counters,
            fields=fields,
            loss_sum=state.loss_sum + jnp.where(finite, outcome.loss, 0.0),
            metric_sums={
                name: state.metric_sums.get(name, jnp.zeros((), jnp.float32))
                + jnp.where(finite, value, 0.0)
                for name, value in outcome.metrics.items()
            },
        )
        return new_state, (outcome.loss.astype(jnp.float32), outcome.grads)

    # Every variant of the step (`flax_loop.programs.lowering`) inlines this one trace:
    # the model's and the loss's Python runs once per loop, not once per
    # variant, and each program is what it would be had it traced them itself.
    return jitted_when_traced(update)


def jitted_when_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    r"""`jax.jit(fn, inline=True)`, made when first called: a set-up whose
    programs are all in the process's cache traces nothing, and a jitted
    function costs ~0.1 ms to make. One for every call after (the set-up's
    thread and the compiling thread share its trace)."""
    made: list[Callable[..., Any]] = []
    lock = threading.Lock()

    def call(*args: Any) -> Any:
        if not made:
            with lock:
                if not made:
                    made.append(jax.jit(fn, inline=True))
        return made[0](*args)

    return call


def build_update(
    apply: Callable[..., Any],
    loss: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    rng_labels: Sequence[str],
    mutable_collections: CollectionFilter,
    axis_name: str | None,
    skip: bool = False,
    ema_decay: float | None = None,
) -> tuple[Update, Step]:
    r"""A supervised task's step (`loss(*outputs, *targets)`, one optimizer
    over every parameter) and the update the loop compiles of it (`counted`).

    Args:
        apply: the model's apply function.
        loss: the loss function, `loss(*outputs, *targets)`.
        optimizer: the optimizer.
        rng_labels: RNG collections to derive keys for (e.g. `["dropout"]`).
        mutable_collections: the collections `apply` may change.
        axis_name, skip, ema_decay: as `task_step` takes them.
    """
    parts = [Part(None, supervised_loss(loss), optimizer, None)]
    objective = Objective(parts, apply, rng_labels, mutable_collections, supervised=True)
    step = task_step(objective, axis_name, skip, ema_decay=ema_decay)
    return counted(step), step
