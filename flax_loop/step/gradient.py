r"""One loss's step: its loss, its gradient and its optimizer's update.

The `compute_loss` form, and the supervised one (`step/supervised`), as a
step: the loss of the batch with the model bound to the step's variables,
its gradient with respect to the step's `model_params`, the optimizer's
update. Written for the whole batch, it is the same program on one device
and on many (the loop lays it out; `flax_loop.programs.lowering`). Built with
an `axis_name`, it is the per-device form instead, for a model or loss
that names the batch axis: each device computes the loss of its share, and
the gradients, the loss, the metrics and the floating-point leaves of the
mutated collections (and of `carry`) are averaged with `pmean` over the
axis. Under `train_only` the step's `model_params` are the trainable part;
the model is bound with them all
(`Context.whole`).

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
>>> objective = Objective([Part(None, supervised_loss(cross_entropy), optax.sgd(0.1), None)],
...                       model.apply, [], False, supervised=True)
>>> step = gradient_step(objective, 0, axis_name=None)
>>> fields = {"model_params": params, "model_state": {},
...           "optimizer_state": optax.sgd(0.1).init(params)}
>>> fields, outcome = step.update(fields, ((x,), (y,)), Context(jax.random.key(0), 0))
>>> outcome.loss.shape, sorted(outcome.grads)
((), ['bias', 'kernel'])
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from flax_loop.data.batch import Batch
from flax_loop.errors import ApplyError, ConfigError
from flax_loop.parallel import key_names
from flax_loop.random import loss_key, step_keys
from flax_loop.step import optimizer
from flax_loop.step.carry import CARRY, pmean_floating, split_carry
from flax_loop.step.core import Context, Fields, Outcome, Step
from flax_loop.step.model import split_loss
from flax_loop.step.objective import Objective, Part
from flax_loop.step.optimizer import PER_DEVICE


def gradient_step(
    objective: Objective, index: int, axis_name: str | None, shards: NamedSharding | None = None
) -> Step:
    r"""Part `index` of the objective as a step, as seen by one device (or,
    with `shards`, by all).

    Args:
        objective: the task's parts, model and frozen models.
        index: the part: its loss, its optimizer (whose state is the step's
            `optimizer_state`) and its own random numbers (a later part's
            keys are folded with its index).
        axis_name: the mesh axis to average over (the per-device form);
            `None` for the step of the whole batch.
        shards: for a sharded state, updated by one program over the whole
            batch (`jax.jit` with shardings, no `shard_map`): the batch's
            layout. The forward pass is mapped with `jax.vmap` over the
            batch's shards along `axis_name`, so each shard has its own
            keys, loss and BatchNorm statistics as a device has with a
            replicated state, and the loss is their mean; its gradient is
            then the averaged gradient, and XLA reduces it as the
            parameters' layout needs (never one whole gradient per shard).

    Returns:
        the step, carrying `CORE` (and updating `CARRY` when the objective's
        losses carry arrays); its `Outcome` holds the part's loss, metrics
        and gradients.
    """
    return Step(dict, _Gradient(objective, index, axis_name, shards).update)


class _Gradient:
    r"""`gradient_step`'s update and the loss it differentiates."""

    def __init__(
        self, objective: Objective, index: int, axis_name: str | None, shards: NamedSharding | None
    ) -> None:
        self.objective, self.index, self.part = objective, index, objective.parts[index]
        self.axis_name, self.shards = axis_name, shards
        self.gradient = jax.value_and_grad(
            self.per_device if shards is None else self.over_shards, has_aux=True, argnums=0
        )

    def per_device(
        self, params: Any, model_state: Any, batch: Batch, context: Context, carry: Any = None
    ) -> tuple[jax.Array, Any]:
        r"""The loss on one device's batch, `(loss, (mutated, metrics, carry))`."""
        objective, axis_name, index = self.objective, self.axis_name, self.index
        device_index = jax.lax.axis_index(axis_name) if axis_name else 0
        number = context.step + 1  # keys derive from the step counted from 1
        rngs = step_keys(context.key, number, device_index, objective.rng_labels)
        rng = loss_key(context.key, number, device_index)
        if index:  # a later part draws numbers of its own
            rngs = {label: jax.random.fold_in(k, index) for label, k in rngs.items()}
            rng = jax.random.fold_in(rng, index)
        whole = params if context.whole is None else context.whole(params)
        bound = objective.bind(whole, model_state, rngs)
        # the loss's `step`: the updates done before this one (0 first)
        result = call_loss(objective, self.part, bound, batch, rng, context, carry)
        refuse_written(bound)
        if objective.carries:
            result, carry = split_carry(result, self.part.name)
        loss_value, metrics = split_loss(result, axis_name is not None)
        return loss_value, (bound.collected(), metrics, carry)

    def over_shards(
        self, params: Any, model_state: Any, batch: Batch, context: Context, carry: Any = None
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
            lambda shard: self.per_device(params, model_state, shard, context, carry),
            axis_name=axis_name,
        )(split)

        # pmean semantics: floating leaves averaged over the shards, integer
        # ones (counters) as shard 0 has them.
        def one(leaf: jax.Array) -> jax.Array:
            return leaf.mean(0) if jnp.issubdtype(leaf.dtype, jnp.inexact) else leaf[0]

        mutated, carry = jax.tree.map(one, (mutated, carry))
        return losses.mean(), (mutated, jax.tree.map(lambda leaf: leaf.mean(0), metrics), carry)

    def loss_of(
        self, model_state: Any, batch: Batch, context: Context, carry: Any
    ) -> Callable[[Any], jax.Array]:
        r"""The step's loss as a function of the trained parameters (optax's
        `value_fn`, for a line search). Not in the per-device form: there
        its gradient would be one device's, and devices whose searches
        differ would wait for each other's collectives for ever."""

        def value_fn(params: Any) -> jax.Array:
            inputs = (params, model_state, batch, context, carry)
            return (self.per_device if self.shards is None else self.over_shards)(*inputs)[0]

        return value_fn

    def update(self, fields: Fields, batch: Batch, context: Context) -> tuple[Fields, Outcome]:
        r"""The step: the loss, its gradient, the optimizer's update."""
        axis_name = self.axis_name
        params, model_state = fields["model_params"], fields["model_state"]
        _refuse_integers(self.part, params)
        (loss_value, (mutated, metrics, carry)), grads = self.gradient(
            params, model_state, batch, context, fields.get(CARRY)
        )
        if axis_name and self.shards is None:
            loss_value, grads, metrics = jax.lax.pmean((loss_value, grads, metrics), axis_name)
            mutated, carry = pmean_floating((mutated, carry), axis_name)
        # The interval's last step also returns the gradients. Without the
        # barrier XLA fuses the gradient into the optimizer's update in one
        # variant and not in the other, and their results differed in the
        # last bits, so a run depended on its checkpoint cadence.
        # Materialized, the gradients are computed alike everywhere (measured
        # free: benchmarks/README.md).
        grads = jax.lax.optimization_barrier(grads)
        per_device = axis_name is not None and self.shards is None
        value_fn = (
            None if per_device else self.loss_of(model_state, batch, context, fields.get(CARRY))
        )
        updates, optimizer_state = optimizer.update(
            self.part.optimizer,
            grads,
            fields["optimizer_state"],
            params,
            optimizer.step_arguments(loss_value, grads, value_fn),
            PER_DEVICE,
        )
        merged = {**model_state, **mutated}
        new = {
            **fields,
            "model_params": optax.apply_updates(params, updates),
            # a collection sown or made by the calls is not state
            "model_state": {name: merged[name] for name in merged if name in model_state},
            "optimizer_state": optimizer_state,
        }
        if self.objective.carries:
            new[CARRY] = carry
        return new, Outcome(loss_value, metrics, grads, jnp.isfinite(loss_value))


def call_loss(
    objective: Objective,
    part: Part,
    bound: Any,
    batch: Batch,
    rng: jax.Array,
    context: Context,
    carry: Any = None,
) -> Any:
    r"""What `part.compute_loss` returns for the batch: a supervised loss
    (`step/supervised`) of the bound model and the `(inputs, targets)`
    batch; a `compute_loss` of the model, the batch as the stream gave it,
    `rng`, `step`, and `frozen` / `carry` when the task has them."""
    assert part.compute_loss is not None, "a task's own step calls no part's loss"
    if objective.supervised:
        return part.compute_loss(bound, batch)
    assert objective.batch_tree is not None, "the feed sets the batches' structure"
    given = objective.batch_tree.unflatten(batch)
    keywords: dict[str, Any] = {"rng": rng, "step": context.step}
    if objective.frozen is not None:
        keywords["frozen"] = context.frozen
    if objective.carries:
        keywords["carry"] = carry
    return part.compute_loss(bound.model, given, **keywords)


def refuse_written(bound: Any) -> None:
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


def _refuse_integers(part: Part, params: Any) -> None:
    r"""A `ConfigError` (while tracing) naming a trained parameter of an
    integer or boolean dtype: it has no gradient."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    for path, leaf in flat:
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            name = "/".join(key_names(path))
            raise ConfigError(
                f"The parameter {name} is {leaf.dtype}: an integer or boolean value "
                "has no gradient, so no optimizer can train it"
                + (f" ({part.name!r})" if part.name is not None else "")
                + ". Keep it in another collection than 'params' (self.variable("
                "'state', ...) in linen, an nnx.Variable that is no nnx.Param), or "
                "leave it out of training with TrainTask(trainable=...)."
            )
