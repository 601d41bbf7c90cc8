r"""A task's step: its parts run in turn, each one optimizer's gradient step.

`in_turn` composes steps of one optimizer each (a GAN's discriminator, then
its generator): each updates the fields with the optimizer state that is
its own (the state holds them by name), so a later part sees what an
earlier one updated. The step's loss is the sum of the parts' losses; each
part's is also a metric, `<name>_loss`, and its metrics are named
`<name>_<metric>`.

`parts_step` builds the task's step of its objective: each part a
`gradient_step` (under `train_only` for a part with a trainable filter),
the parts in turn when there are several, then `with_carry` for a task's
`carry` and `with_frozen` for its frozen models.

>>> import jax, optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop.step.objective import Objective, Part
>>> from flax_loop.step.supervised import supervised_loss
>>> from flax_loop.step.core import Context
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> model = nn.Dense(3)
>>> x, y = np.ones((8, 4), np.float32), np.zeros(8, np.int32)
>>> params = model.init(jax.random.key(0), x)["params"]
>>> parts = [Part(name, supervised_loss(cross_entropy), optax.sgd(0.1), None)
...          for name in ("first", "second")]
>>> objective = Objective(parts, model.apply, [], False, supervised=True)
>>> step = parts_step(objective, axis_name=None)
>>> fields = step.init({"model_params": params, "model_state": {},
...                     "optimizer_state": objective.init_optimizer(params)})
>>> fields, outcome = step.update(fields, ((x,), (y,)), Context(jax.random.key(0), 0))
>>> sorted(outcome.metrics), sorted(outcome.grads)
(['first_loss', 'second_loss'], ['first', 'second'])
"""

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.sharding import NamedSharding

from flax_loop.data.batch import Batch
from flax_loop.step.carry import with_carry
from flax_loop.step.core import Context, Fields, Outcome, Step, chain
from flax_loop.step.frozen import with_frozen
from flax_loop.step.gradient import gradient_step
from flax_loop.step.objective import Objective
from flax_loop.step.trainable import train_only


def in_turn(named: Sequence[tuple[str, Step]]) -> Step:
    r"""The steps run in turn, each with the optimizer state under its name.

    Args:
        named: `(name, step)` pairs, in the order each update runs them; the
            fields' `optimizer_state` is a dict by these names.

    Returns:
        the step carrying every field the steps declare; its `Outcome`'s
        loss is the sum of theirs, its gradients a dict by name.
    """
    names = [name for name, _ in named]

    def init(fields: Fields) -> Fields:
        states = dict(fields["optimizer_state"])
        for name, step in named:
            fields = step.init({**fields, "optimizer_state": states[name]})
            states[name] = fields["optimizer_state"]
        return {**fields, "optimizer_state": {name: states[name] for name in names}}

    def update(fields: Fields, batch: Batch, context: Context) -> tuple[Fields, Outcome]:
        states = dict(fields["optimizer_state"])
        losses, grads, metrics = [], {}, {}
        for name, step in named:
            fields, outcome = step.update(
                {**fields, "optimizer_state": states[name]}, batch, context
            )
            states[name], grads[name] = fields["optimizer_state"], outcome.grads
            losses.append(outcome.loss)
            metrics[f"{name}_loss"] = outcome.loss.astype(jnp.float32)
            metrics.update({f"{name}_{metric}": v for metric, v in outcome.metrics.items()})
        loss = sum(losses[1:], losses[0])
        fields = {**fields, "optimizer_state": {name: states[name] for name in names}}
        return fields, Outcome(loss, metrics, grads, jnp.isfinite(loss))

    declared = {name: field for _, step in named for name, field in step.fields.items()}
    return Step(init, update, declared)


def parts_step(
    objective: Objective,
    axis_name: str | None,
    shards: NamedSharding | None = None,
    carry: Any = None,
) -> Step:
    r"""The objective's step, as seen by one device (or, with `shards`, by all).

    Args:
        objective: the step's parts, model and frozen models.
        axis_name, shards: as `gradient_step` takes them.
        carry: the initial arrays the losses carry (`TrainTask.carry`), or
            `None`: each loss then takes `carry=` and returns `(loss, metrics,
            new_carry)`, which the next part (and step) is given.

    Returns:
        the step, carrying `CORE` (and `CARRY` with a `carry`); its
        `Outcome.grads` are the part's gradients, or with several parts a
        dict of each part's by name.
    """
    steps = [
        _part_step(objective, index, axis_name, shards) for index in range(len(objective.parts))
    ]
    if objective.keyed:
        base = in_turn([(str(part.name), step) for part, step in zip(objective.parts, steps)])
    else:
        base = steps[0]
    transforms = []
    if carry is not None:
        transforms.append(with_carry(carry))
    if objective.frozen is not None:
        transforms.append(with_frozen(objective.frozen))
    return chain(base, *transforms)


def _part_step(
    objective: Objective, index: int, axis_name: str | None, shards: NamedSharding | None
) -> Step:
    r"""Part `index`'s `gradient_step`, under `train_only` with a trainable filter."""
    step = gradient_step(objective, index, axis_name, shards)
    if objective.parts[index].trainable is None:
        return step

    def partition(params: Any) -> Any:
        return objective.partitions(params)[index]

    return train_only(partition)(step)
