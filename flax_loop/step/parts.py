r"""The task's step: its parts run in turn, each one optimizer's gradient update.

Each device computes the loss and gradients of its share of the batch; the
gradients, the loss and the floating-point leaves of the mutated collections
are averaged with `pmean` over the data axis; then every device applies the
same optimizer update to its replica. On one device the same code runs
under a plain `jax.jit`, without collectives.

>>> import jax, optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop.step.objective import Objective, Part, supervised_loss
>>> from flax_loop.step.core import Context
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> model = nn.Dense(3)
>>> x, y = np.ones((8, 4), np.float32), np.zeros(8, np.int32)
>>> params = model.init(jax.random.key(0), x)["params"]
>>> objective = Objective([Part(None, supervised_loss(cross_entropy), optax.sgd(0.1), None)],
...                       model.apply, [], False, supervised=True)
>>> step = parts_step(objective, axis_name=None)
>>> fields = step.init({"model_params": params, "model_state": {},
...                     "optimizer_state": optax.sgd(0.1).init(params)})
>>> fields, outcome = step.update(fields, ((x,), (y,)), Context(jax.random.key(0), 0))
>>> outcome.loss.shape, sorted(outcome.grads)
((), ['bias', 'kernel'])
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from flax_loop.data.batch import Batch
from flax_loop.errors import ApplyError, ConfigError, LossError
from flax_loop.parallel import key_names
from flax_loop.random import loss_key, step_keys
from flax_loop.step.core import Context, Field, Fields, Outcome, Step
from flax_loop.step.model import split_loss
from flax_loop.step.objective import Objective


def _pmean_floating(tree: Any, axis_name: str) -> Any:
    r"""Averages floating-point leaves over the axis; integer counters stay."""

    def average(leaf: jax.Array) -> jax.Array:
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            return jax.lax.pmean(leaf, axis_name)
        return leaf

    return jax.tree.map(average, tree)


CARRY = "carry"
r"""The field a task's `carry` is carried (and saved) as."""


def carry_init(carry: Any) -> Any:
    r"""A step's `init` declaring the `CARRY` field of the initial arrays
    `carry`, or of `carry(params)` for a function of the initial parameters
    (a target network starting as the online one); nothing without."""

    def init(fields: Fields) -> Fields:
        if carry is None:
            return dict(fields)
        value = carry(fields["model_params"]) if callable(carry) else carry
        # copies: a carried array never shares a buffer with another field
        return {**fields, CARRY: jax.tree.map(jnp.array, value)}

    return init


def parts_step(
    objective: Objective,
    axis_name: str | None,
    shards: NamedSharding | None = None,
    carry: Any = None,
) -> Step:
    r"""The objective's step, as seen by one device (or, with `shards`, by all).

    Each of the objective's parts, in order, computes its loss with the
    model bound to the current variables, its gradient with respect to its
    trainable parameters, and applies its optimizer; a later part sees what
    an earlier one updated. The step's loss is the sum of the parts' losses;
    with several parts each one's is also a metric, `<name>_loss`.

    Args:
        objective: the step's parts, model and frozen models.
        axis_name: the mesh axis to average over; `None` on one device.
        shards: for a sharded state, updated by one program over the whole
            batch (`jax.jit` with shardings, no `shard_map`): the batch's
            layout. The forward pass is mapped with `jax.vmap` over the
            batch's shards along `axis_name`, so each shard has its own
            keys, loss and BatchNorm statistics as a device has with a
            replicated state, and the loss is their mean; its gradient is
            then the averaged gradient, and XLA reduces it as the
            parameters' layout needs (never one whole gradient per shard).

        carry: the initial arrays the losses carry (`TrainTask.carry`), or
            `None`: each loss then takes `carry=` and returns `(loss, metrics,
            new_carry)`, which the next part (and step) is given.

    Returns:
        the step, carrying `CORE` (and `CARRY` with a `carry`); its
        `Outcome.grads` are the last part's gradients, or with several parts
        a dict of each part's by name.
    """
    fields = {} if carry is None else {CARRY: Field()}
    return Step(carry_init(carry), _Parts(objective, axis_name, shards).update, fields)


class _Parts:
    r"""`parts_step`'s update: its functions share the objective, the axis
    and the parts' partitions (known once the first trace sees the
    parameters)."""

    def __init__(
        self, objective: Objective, axis_name: str | None, shards: NamedSharding | None
    ) -> None:
        self.objective, self.axis_name, self.shards = objective, axis_name, shards
        self.partitions: list[Any] = []
        self.gradient = jax.value_and_grad(
            self.per_device if shards is None else self.over_shards, has_aux=True, argnums=0
        )

    def per_device(
        self,
        trainable: Any,
        params: Any,
        model_state: Any,
        batch: Batch,
        context: Context,
        index: int,
        carry: Any = None,
    ) -> tuple[jax.Array, Any]:
        r"""Part `index`'s loss on one device's batch, `(loss, (mutated,
        metrics, carry))`."""
        objective, axis_name = self.objective, self.axis_name
        device_index = jax.lax.axis_index(axis_name) if axis_name else 0
        number = context.step + 1  # keys derive from the step counted from 1
        rngs = step_keys(context.key, number, device_index, objective.rng_labels)
        rng = loss_key(context.key, number, device_index)
        if index:  # a later part draws numbers of its own
            rngs = {label: jax.random.fold_in(k, index) for label, k in rngs.items()}
            rng = jax.random.fold_in(rng, index)
        part, partition = objective.parts[index], self.partitions[index]
        bound = objective.bind(partition.merge(params, trainable), model_state, rngs)
        # the loss's `step`: the updates done before this one (0 first)
        result = objective.call_loss(part, bound, batch, rng, context.step, context.frozen, carry)
        _refuse_written(bound)
        if objective.carries:
            result, carry = split_carry(result, part.name)
        loss_value, metrics = split_loss(result, axis_name is not None)
        return loss_value, (bound.collected(), metrics, carry)

    def over_shards(
        self,
        trainable: Any,
        params: Any,
        model_state: Any,
        batch: Batch,
        context: Context,
        index: int,
        carry: Any = None,
    ) -> tuple[jax.Array, Any]:
        r"""`per_device` mapped over the batch's shards (a sharded state)."""
        shards, axis_name = self.shards, self.axis_name
        assert shards is not None and axis_name is not None
        n_shards = shards.mesh.shape[axis_name]
        split = jax.tree.map(
            lambda leaf: leaf.reshape(n_shards, leaf.shape[0] // n_shards, *leaf.shape[1:]), batch
        )
        split = jax.lax.with_sharding_constraint(split, shards)
        losses, (mutated, metrics, carry) = jax.vmap(
            lambda shard: self.per_device(
                trainable, params, model_state, shard, context, index, carry
            ),
            axis_name=axis_name,
        )(split)

        # pmean semantics: floating leaves averaged over the shards, integer
        # ones (counters) as shard 0 has them.
        def one(leaf: jax.Array) -> jax.Array:
            return leaf.mean(0) if jnp.issubdtype(leaf.dtype, jnp.inexact) else leaf[0]

        mutated, carry = jax.tree.map(one, (mutated, carry))
        return losses.mean(), (mutated, jax.tree.map(lambda leaf: leaf.mean(0), metrics), carry)

    def run_part(
        self, index: int, fields: Fields, optimizer_state: Any, batch: Batch, context: Context
    ) -> tuple[Any, ...]:
        r"""Part `index`: its loss, gradient and optimizer update."""
        partition, axis_name = self.partitions[index], self.axis_name
        params, model_state = fields["model_params"], fields["model_state"]
        trainable = partition.split(params)
        (loss_value, (mutated, metrics, carry)), grads = self.gradient(
            trainable, params, model_state, batch, context, index, fields.get(CARRY)
        )
        if axis_name and self.shards is None:
            loss_value, grads, metrics = jax.lax.pmean((loss_value, grads, metrics), axis_name)
            mutated, carry = _pmean_floating((mutated, carry), axis_name)
        # The interval's last step also returns the gradients. Without the
        # barrier XLA fuses the gradient into the optimizer's update in one
        # variant and not in the other, and their results differed in the
        # last bits, so a run depended on its checkpoint cadence.
        # Materialized, the gradients are computed alike everywhere (measured
        # free: benchmarks/README.md).
        grads = jax.lax.optimization_barrier(grads)
        updates, optimizer_state = self.objective.parts[index].optimizer.update(
            grads, optimizer_state, trainable
        )
        params = partition.merge(params, optax.apply_updates(trainable, updates))
        fields = {**fields, "model_params": params, "model_state": {**model_state, **mutated}}
        if self.objective.carries:
            fields[CARRY] = carry
        return loss_value, metrics, grads, fields, optimizer_state

    def update(self, fields: Fields, batch: Batch, context: Context) -> tuple[Fields, Outcome]:
        r"""The step: every part in turn."""
        objective = self.objective
        if not self.partitions:
            self.partitions.extend(objective.partitions(fields["model_params"]))
            _refuse_integers(objective, self.partitions, fields["model_params"])
        model_state = fields["model_state"]
        optimizer_states = objective.of_parts(fields["optimizer_state"])
        losses, all_grads, metrics = [], [], {}
        for index, part in enumerate(objective.parts):
            loss_value, part_metrics, grads, fields, optimizer_states[index] = self.run_part(
                index, fields, optimizer_states[index], batch, context
            )
            losses.append(loss_value)
            all_grads.append(grads)
            if part.name is None:
                metrics.update(part_metrics)
            else:
                metrics[f"{part.name}_loss"] = loss_value.astype(jnp.float32)
                metrics.update({f"{part.name}_{name}": v for name, v in part_metrics.items()})
        loss_value = losses[0] if len(losses) == 1 else sum(losses[1:], losses[0])
        mutated = fields["model_state"]
        fields = {
            **fields,
            # a collection sown or made by the calls is not state
            "model_state": {name: mutated[name] for name in mutated if name in model_state},
            "optimizer_state": objective.by_part(optimizer_states),
        }
        grads = objective.by_part(all_grads)
        return fields, Outcome(loss_value, metrics, grads, jnp.isfinite(loss_value))


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


def _refuse_written(bound: Any) -> None:
    r"""An `ApplyError` (while tracing) naming the parameters the loss
    assigned: the step applies the optimizer to the values it gave the
    model, so the assignment would be lost."""
    written: list[str] = getattr(bound, "written", list)()
    if written:
        raise ApplyError(
            f"The loss assigned new values to trained parameters ({', '.join(written[:5])}"
            f"{', ...' if len(written) > 5 else ''}); the step differentiates and updates "
            "the parameters it gave the model, so the assignment would be dropped. Keep "
            "a value the step changes in TrainTask(carry=...) with update=..., or in a "
            "non-parameter nnx.Variable (its changes carry over from step to step)."
        )


def _refuse_integers(objective: Objective, partitions: list[Any], params: Any) -> None:
    r"""A `ConfigError` (while tracing) naming a trained parameter of an
    integer or boolean dtype: it has no gradient."""
    for part, partition in zip(objective.parts, partitions):
        flat, _ = jax.tree_util.tree_flatten_with_path(partition.split(params))
        for path, leaf in flat:
            if leaf is not None and not jnp.issubdtype(leaf.dtype, jnp.inexact):
                name = "/".join(key_names(path))
                raise ConfigError(
                    f"The parameter {name} is {leaf.dtype}: an integer or boolean value "
                    "has no gradient, so no optimizer can train it"
                    + (f" ({part.name!r})" if part.name is not None else "")
                    + ". Keep it in another collection than 'params' (self.variable("
                    "'state', ...) in linen, an nnx.Variable that is no nnx.Param), or "
                    "leave it out of training with TrainTask(trainable=...)."
                )
