r"""The compiled data-parallel update: per-device code, averaged gradients.

Each device computes the loss and gradients of its share of the batch; the
gradients, the loss and the floating-point leaves of the mutated collections
are averaged with `pmean` over the data axis; then every device applies the
same optimizer update to its replica. On one device the same code runs
under a plain `jax.jit`, without collectives (`shard_map` costs ~11% there).

>>> import jax, optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop.state import TrainState
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> model = nn.Dense(3)
>>> x, y = np.ones((8, 4), np.float32), np.zeros(8, np.int32)
>>> params, batch = model.init(jax.random.key(0), x)["params"], ((x,), (y,))
>>> update = build_update(model.apply, cross_entropy, optax.sgd(0.1), rng_labels=[],
...                       mutable_collections=False, axis_name=None)
>>> state = TrainState.create(params, {}, optax.sgd(0.1).init(params), step=0)
>>> state, (loss, grads) = update(state, batch, jax.random.key(0))
>>> int(state.step), loss.shape
(1, ())
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.core.scope import CollectionFilter
from jax.sharding import NamedSharding

from flax_loop.batch import Batch
from flax_loop.errors import ApplyError
from flax_loop.model import split_loss
from flax_loop.objective import Objective, Part, StepInputs, supervised_loss
from flax_loop.parallel import key_names
from flax_loop.random import loss_key, step_keys
from flax_loop.state import TrainState, all_finite

NONFINITE_MODES = ("raise", "skip")

Update = Callable[["TrainState", Batch, jax.Array], tuple["TrainState", tuple[jax.Array, Any]]]


def _pmean_floating(tree: Any, axis_name: str) -> Any:
    r"""Averages floating-point leaves over the axis; integer counters stay."""

    def average(leaf: jax.Array) -> jax.Array:
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            return jax.lax.pmean(leaf, axis_name)
        return leaf

    return jax.tree.map(average, tree)


def _check_kept(what: str, new: Any, old: Any) -> None:
    r"""Raises an `ApplyError` (while tracing) naming each variable whose dtype
    or shape a step changed: the state keeps them from step to step, in
    every layout (a packed state would otherwise cast it silently)."""
    changed = [
        f"{'/'.join(key_names(path))}: {before.dtype}{list(before.shape)} -> "
        f"{after.dtype}{list(after.shape)}"
        for (path, before), after in zip(
            jax.tree_util.tree_flatten_with_path(old)[0], jax.tree.leaves(new)
        )
        if before.dtype != after.dtype or before.shape != after.shape
    ]
    if changed and jax.tree.structure(new) == jax.tree.structure(old):  # type: ignore[operator]
        raise ApplyError(
            f"A step changed the dtype or shape of {what} ({'; '.join(changed[:5])}"
            f"{'; ...' if len(changed) > 5 else ''}). A variable keeps its dtype and shape "
            "from step to step: cast the new value in the model (value.astype(old.dtype)), "
            "or create the variable with the dtype it takes."
        )


def _keep_if(finite: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def build_update(
    apply: Callable[..., Any],
    loss: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    rng_labels: Sequence[str],
    mutable_collections: CollectionFilter,
    axis_name: str | None,
    skip_nonfinite: bool = False,
    shards: NamedSharding | None = None,
    ema_decay: float | None = None,
) -> Update:
    r"""The update of a supervised step, `loss(*outputs, *targets)` with one
    optimizer over every parameter (`build_step` of that objective).

    Args:
        apply: the model's apply function.
        loss: the loss function, `loss(*outputs, *targets)`.
        optimizer: the optimizer.
        rng_labels: RNG collections to derive keys for (e.g. `["dropout"]`).
        mutable_collections: the collections `apply` may change.
        axis_name, skip_nonfinite, shards, ema_decay: as `build_step` takes them.
    """
    parts = [Part(None, supervised_loss(loss), optimizer, None)]
    objective = Objective(parts, apply, rng_labels, mutable_collections, supervised=True)
    return build_step(objective, axis_name, skip_nonfinite, shards, ema_decay)


def build_step(
    objective: Objective,
    axis_name: str | None,
    skip_nonfinite: bool = False,
    shards: NamedSharding | None = None,
    ema_decay: float | None = None,
) -> Update:
    r"""The update of one step, as seen by one device (or, with `shards`, by all).

    Each of the objective's parts, in order, computes its loss with the
    model bound to the current variables, its gradient with respect to its
    trainable parameters, and applies its optimizer; a later part sees what
    an earlier one updated. The step's loss is the sum of the parts' losses;
    with several parts each one's loss is also a metric, `<name>_loss`.

    Args:
        objective: the step's parts, model and frozen models.
        axis_name: the mesh axis to average over; `None` on one device.
        skip_nonfinite: leave the parameters, the optimizer state and the
            model state as they were when the loss or a gradient is not
            finite (the state keeps its structure either way, so a file
            resumes in either mode).
        shards: for a sharded state, updated by one program over the whole
            batch (`jax.jit` with shardings, no `shard_map`): the batch's
            layout. The forward pass is mapped with `jax.vmap` over the
            batch's shards along `axis_name`, so each shard has its own
            keys, loss and BatchNorm statistics as a device has with a
            replicated state, and the loss is their mean; its gradient is
            then the averaged gradient, and XLA reduces it as the
            parameters' layout needs (never one whole gradient per shard).
        ema_decay: with a value, the state's `ema_params` become
            `ema_decay * ema_params + (1 - ema_decay) * params` after each
            applied update.

    Returns:
        `update(state, batch, inputs) -> (state, (loss, grads))`, `inputs` a
        `StepInputs` (or, without frozen models, the training key alone);
        `grads` the last part's gradients, or with several parts a dict of
        each part's by name.
    """
    per_device_shapes = axis_name is not None

    def per_device(
        trainable: Any,
        params: Any,
        model_state: Any,
        batch: Batch,
        key: jax.Array,
        step: jax.Array,
        frozen: Any,
        index: int,
    ) -> tuple[jax.Array, Any]:
        device_index = jax.lax.axis_index(axis_name) if axis_name else 0
        rngs = step_keys(key, step, device_index, objective.rng_labels)
        rng = loss_key(key, step, device_index)
        if index:  # a later part draws numbers of its own
            rngs = {label: jax.random.fold_in(k, index) for label, k in rngs.items()}
            rng = jax.random.fold_in(rng, index)
        part, partition = objective.parts[index], partitions[index]
        bound = objective.bind(partition.merge(params, trainable), model_state, rngs)
        result = objective.call_loss(part, bound, batch, rng, step, frozen)
        loss_value, metrics = split_loss(result, per_device_shapes)
        return loss_value, (bound.collected(), metrics)

    def over_shards(
        trainable: Any,
        params: Any,
        model_state: Any,
        batch: Batch,
        key: jax.Array,
        step: jax.Array,
        frozen: Any,
        index: int,
    ) -> tuple[jax.Array, Any]:
        assert shards is not None and axis_name is not None
        n_shards = shards.mesh.shape[axis_name]
        split = jax.tree.map(
            lambda leaf: leaf.reshape(n_shards, leaf.shape[0] // n_shards, *leaf.shape[1:]), batch
        )
        split = jax.lax.with_sharding_constraint(split, shards)
        losses, (mutated, metrics) = jax.vmap(
            lambda shard: per_device(
                trainable, params, model_state, shard, key, step, frozen, index
            ),
            axis_name=axis_name,
        )(split)
        # pmean semantics: floating leaves averaged over the shards, integer
        # ones (counters) as shard 0 has them.
        mutated = jax.tree.map(
            lambda leaf: leaf.mean(0) if jnp.issubdtype(leaf.dtype, jnp.inexact) else leaf[0],
            mutated,
        )
        return losses.mean(), (mutated, jax.tree.map(lambda leaf: leaf.mean(0), metrics))

    gradient = jax.value_and_grad(
        per_device if shards is None else over_shards, has_aux=True, argnums=0
    )
    partitions: list[Any] = []

    def run_part(
        index: int,
        params: Any,
        model_state: Any,
        optimizer_state: Any,
        batch: Batch,
        key: jax.Array,
        step: jax.Array,
        frozen: Any,
    ) -> tuple[Any, ...]:
        partition = partitions[index]
        trainable = partition.split(params)
        (loss_value, (mutated, metrics)), grads = gradient(
            trainable, params, model_state, batch, key, step, frozen, index
        )
        if axis_name and shards is None:
            loss_value, grads, metrics = jax.lax.pmean((loss_value, grads, metrics), axis_name)
            mutated = _pmean_floating(mutated, axis_name)
        # The interval's last step also returns the gradients. Without the
        # barrier XLA fuses the gradient into the optimizer's update in one
        # variant and not in the other, and their results differed in the
        # last bits (a BatchNorm MLP's parameters by 4e-2 after 24 steps), so
        # a run depended on its checkpoint cadence. Materialized, the
        # gradients are computed alike everywhere (measured free:
        # benchmarks/README.md).
        grads = jax.lax.optimization_barrier(grads)
        updates, optimizer_state = objective.parts[index].optimizer.update(
            grads, optimizer_state, trainable
        )
        params = partition.merge(params, optax.apply_updates(trainable, updates))
        return loss_value, metrics, grads, params, {**model_state, **mutated}, optimizer_state

    def update(
        state: TrainState, batch: Batch, inputs: Any
    ) -> tuple[TrainState, tuple[jax.Array, Any]]:
        key, frozen = inputs if isinstance(inputs, StepInputs) else (inputs, None)
        if not partitions:
            partitions.extend(objective.partitions(state.model_params))
        step = state.counters[0] + 1
        params, model_state = state.model_params, state.model_state
        optimizer_states = objective.of_parts(state.optimizer_state)
        losses, all_grads, metrics = [], [], {}
        for index, part in enumerate(objective.parts):
            loss_value, part_metrics, grads, params, model_state, optimizer_states[index] = (
                run_part(
                    index, params, model_state, optimizer_states[index], batch, key, step, frozen
                )
            )
            losses.append(loss_value)
            all_grads.append(grads)
            if part.name is None:
                metrics.update(part_metrics)
            else:
                metrics[f"{part.name}_loss"] = loss_value.astype(jnp.float32)
                metrics.update({f"{part.name}_{name}": v for name, v in part_metrics.items()})
        loss_value = losses[0] if len(losses) == 1 else sum(losses[1:], losses[0])
        grads = objective.by_part(all_grads)
        optimizer_state = objective.by_part(optimizer_states)
        mutated = {name: model_state[name] for name in model_state if name in state.model_state}
        _check_kept("model_state", mutated, state.model_state)
        _check_kept("model_params", params, state.model_params)
        # Checking every gradient each step costs ~10% of an MLP's step, so the
        # step checks its loss; a non-finite gradient shows up in the next loss
        # and, at the latest, at the checkpoint (`close_interval`).
        finite = jnp.isfinite(loss_value)
        if skip_nonfinite:
            finite = finite & all_finite(grads)
            params = _keep_if(finite, params, state.model_params)
            optimizer_state = _keep_if(finite, optimizer_state, state.optimizer_state)
            mutated = _keep_if(finite, mutated, state.model_state)
        ema_params = state.ema_params
        if ema_decay is not None:
            kept = objective.trained(state.model_params).frozen_mask()
            ema_params = jax.tree.map(
                # a frozen parameter's average is the parameter, bit for bit
                lambda average, new, is_frozen: (
                    new.astype(average.dtype)
                    if is_frozen
                    else average * ema_decay + new.astype(average.dtype) * (1 - ema_decay)
                ),
                state.ema_params,
                params,
                jax.tree.map(lambda _: False, params) if kept is None else kept,
            )
            if skip_nonfinite:
                ema_params = _keep_if(finite, ema_params, state.ema_params)
        _, n_bad, first_bad = state.counters
        bad = (~finite).astype(jnp.int32)
        counters = jnp.stack(
            [step, n_bad + bad, jnp.where((first_bad == 0) & (bad == 1), step, first_bad)]
        )
        new_state = state._replace(
            counters=counters,
            model_params=params,
            model_state=mutated,
            optimizer_state=optimizer_state,
            ema_params=ema_params,
            loss_sum=state.loss_sum + jnp.where(finite, loss_value, 0.0),
            metric_sums={
                name: state.metric_sums.get(name, jnp.zeros((), jnp.float32))
                + jnp.where(finite, value, 0.0)
                for name, value in metrics.items()
            },
        )
        return new_state, (loss_value.astype(jnp.float32), grads)

    # Every variant of the step (`flax_loop.lowering`) inlines this one trace:
    # the model's and the loss's Python runs once per loop, not once per
    # variant, and each program is what it would be had it traced them itself.
    return jax.jit(update, inline=True)
