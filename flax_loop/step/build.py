r"""The step a `TrainTask` describes, composed of the built-in transforms.

`task_step` is the objective's parts (`flax_loop.step.parts`) with the
moving average (`with_ema`) and the skipping of non-finite updates
(`skip_nonfinite`) applied as the options ask; `build_step` is that step
as the loop compiles it (`counted`).

>>> import jax, optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop.step.state import TrainState
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> model = nn.Dense(3)
>>> x, y = np.ones((8, 4), np.float32), np.zeros(8, np.int32)
>>> params, batch = model.init(jax.random.key(0), x)["params"], ((x,), (y,))
>>> update, step = build_update(model.apply, cross_entropy, optax.sgd(0.1), rng_labels=[],
...                             mutable_collections=False, axis_name=None, ema_decay=0.9)
>>> fields = step.init({"model_params": params, "model_state": {},
...                     "optimizer_state": optax.sgd(0.1).init(params)})
>>> state, (loss, grads) = update(TrainState.create(fields, step=0), batch, jax.random.key(0))
>>> int(state.step), loss.shape, sorted(state.fields)
(1, (), ['ema_params', 'model_params', 'model_state', 'optimizer_state'])
"""

from collections.abc import Callable, Sequence
from typing import Any

import optax
from flax.core.scope import CollectionFilter
from jax.sharding import NamedSharding

from flax_loop.step.core import Step, Transform, chain
from flax_loop.step.ema import with_ema
from flax_loop.step.nonfinite import skip_nonfinite
from flax_loop.step.objective import Objective, Part
from flax_loop.step.own import UpdateFn, own_step
from flax_loop.step.parts import parts_step
from flax_loop.step.statistics import Update, counted
from flax_loop.step.supervised import supervised_loss


def task_step(
    objective: Objective,
    axis_name: str | None,
    skip: bool = False,
    shards: NamedSharding | None = None,
    ema_decay: float | None = None,
    frozen: Callable[[Any], Any] | None = None,
    transforms: Sequence[Transform] = (),
    update: UpdateFn | None = None,
    carry: Any = None,
    reads_data: bool = True,
) -> Step:
    r"""The objective's step with the transforms the options ask for.

    Args:
        objective: the step's parts, model and frozen models.
        axis_name, shards: as `parts_step` takes them.
        skip: leave every field as it was after a non-finite step.
        ema_decay: with a value, carry the parameters' moving average.
        frozen: `frozen(params)`, the parameters no optimizer trains (a
            tree of booleans, or `None`): their average is the parameter.
        transforms: the task's own transforms (`TrainTask.transforms`),
            applied first.
        update, carry: a step of the task's own (`TrainTask.update`) and the
            arrays it carries, instead of the objective's parts.
        reads_data: whether the task has a data stream (`own_step`).
    """
    applied = list(transforms)
    if ema_decay is not None:
        applied.append(with_ema(ema_decay, frozen))
    if skip:  # outermost: a skipped step leaves every field as it was
        applied.append(skip_nonfinite())
    if update is not None:
        base = own_step(update, objective, carry, axis_name, shards, reads_data)
    else:
        base = parts_step(objective, axis_name, shards, carry)
    return chain(base, *applied)


def build_step(
    objective: Objective,
    axis_name: str | None,
    skip: bool = False,
    shards: NamedSharding | None = None,
    ema_decay: float | None = None,
    frozen: Callable[[Any], Any] | None = None,
) -> tuple[Update, Step]:
    r"""`task_step`'s step, and the update the loop compiles of it (`counted`)."""
    step = task_step(objective, axis_name, skip, shards, ema_decay, frozen)
    return counted(step), step


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
    r"""`build_step` of a supervised task: `loss(*outputs, *targets)` with one
    optimizer over every parameter.

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
    return build_step(objective, axis_name, skip, ema_decay=ema_decay)
