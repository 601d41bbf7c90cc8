r"""Your own step: `TrainTask(update=fn)`, with every guarantee of the built-in forms.

`fn(state, batch, *, rng, step) -> (state, metrics)` is traced and compiled
by the loop. `state` is a `StepState`: the parameters, the model state, the
optimizer state (a dict by name when the optimizers are), the arrays the
step carries (`TrainTask(carry=...)`), and the means to use them:
`state.model(params)` (the model bound to `params`, as `compute_loss` gets
it) and `state.apply_gradients(grads, name=None)` (one optimizer applied
to its trainable parameters), which a
step may call any number of times, in Python loops or in `lax.scan`.

>>> import jax, optax
>>> import jax.numpy as jnp
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop.step.core import Context
>>> from flax_loop.step.objective import Objective, Part
>>> model = nn.Dense(1)
>>> x = np.ones((8, 3), np.float32)
>>> params = model.init(jax.random.key(0), x)["params"]
>>> def update(state, batch, *, rng, step):
...     for _ in range(3):  # three updates of one optimizer in a step
...         loss, grads = jax.value_and_grad(lambda p: state.model(p)(batch).mean())(state.params)
...         state = state.apply_gradients(grads)
...     return state, {"loss": loss}
>>> objective = Objective([Part(None, None, optax.sgd(0.1), None)], model.apply, [], False)
>>> step = own_step(update, objective, carry=None, axis_name=None)
>>> fields = step.init({"model_params": params, "model_state": {},
...                     "optimizer_state": optax.sgd(0.1).init(params)})
>>> fields, outcome = step.update(fields, x, Context(jax.random.key(0), jnp.int32(0)))
>>> round(float(fields["model_params"]["bias"][0]), 6)  # three steps of -0.1 * d(mean)/d(bias)
-0.3
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding

from flax_loop.errors import ConfigError, LossError
from flax_loop.parallel import key_names
from flax_loop.random import loss_key, step_keys
from flax_loop.step.carry import CARRY, pmean_floating, with_carry
from flax_loop.step.core import Context, Fields, Outcome, Step, chain
from flax_loop.step.frozen import with_frozen
from flax_loop.step.gradient import refuse_written
from flax_loop.step.model import split_loss
from flax_loop.step.modules import BoundNNX
from flax_loop.step.objective import Objective
from flax_loop.step.optimizer import PER_DEVICE
from flax_loop.step.optimizer import update as optimizer_update

UpdateFn = Callable[..., Any]
r"""`update(state, batch, *, rng, step) -> (state, metrics)`."""


class _Env:
    r"""What a `StepState` needs besides its arrays: the same object for the
    whole step (the state's static part, so the state passes through
    `lax.scan` and `fori_loop`)."""

    def __init__(
        self,
        objective: Objective,
        partitions: list[Any],
        axis_name: str | None,
        rngs: dict[str, jax.Array],
        frozen: Any,
    ) -> None:
        self.objective, self.partitions = objective, partitions
        self.axis_name, self.rngs, self.frozen = axis_name, rngs, frozen
        self.names = [part.name for part in objective.parts]
        self.bound: dict[int, Any] = {}
        r"""the bindings `StepState.model` made, by the model's id"""

    def index(self, name: str | None) -> int:
        if name in self.names:
            return self.names.index(name)
        if name is None:
            raise ConfigError(
                f"state.apply_gradients needs name=: the task has the optimizers "
                f"{self.names}; say which one applies the gradients."
            )
        known = self.names if self.names != [None] else "one optimizer (name=None)"
        raise ConfigError(
            f"state.apply_gradients(name={name!r}): the task has no optimizer of that "
            f"name; it has {known}."
        )


@struct.dataclass
class StepState:
    r"""The state your own step (`TrainTask(update=fn)`) takes and returns.

    A pytree: pass it through `jax.lax.scan` or `fori_loop`, change it with
    `state.replace(...)`; its structure, dtypes and shapes stay from step to
    step.
    """

    params: Any
    r"""the model's parameters."""

    model_state: Any
    r"""the model's other collections (`batch_stats`), as the step carries them."""

    opt_state: Any
    r"""the optimizer state; a dict by name when `TrainTask.optimizer` is a dict."""

    carry: Any
    r"""the arrays the step carries (`TrainTask(carry=...)`); `None` without."""

    grads: Any
    r"""the gradients each optimizer last applied this step (zeros before
    its first `apply_gradients`), as `Checkpoint.grads` shows them."""

    env: _Env = struct.field(pytree_node=False)

    @property
    def frozen(self) -> dict[str, Any]:
        r"""the frozen models (`TrainTask(frozen=...)`), NNX modules in
        evaluation mode, anything else as given; `{}` without."""
        return self.env.frozen

    def model(self, params: Any = None, *, rng: jax.Array | None = None) -> Any:
        r"""The model bound to `params` (the state's by default) and the
        state's model state, as `compute_loss` gets it: an NNX module, or for
        linen a callable `model(*inputs, method=..., **kwargs)`. Call it and
        differentiate through it. Its random streams are the step's; pass
        `rng` to draw others (in a loop, `jax.random.fold_in(rng, i)`)."""
        env = self.env
        rngs = env.rngs
        if rng is not None:
            rngs = {label: jax.random.fold_in(rng, index) for index, label in enumerate(rngs)}
        params = self.params if params is None else params
        bound = env.objective.bind(params, self.model_state, rngs)
        env.bound[id(bound.model)] = bound  # held: the id stays its own
        return bound.model

    def model_state_after(self, model: Any) -> Any:
        r"""The model state after the calls of `model` (one `state.model()`
        gave): what a BatchNorm's statistics are after them. Return it from
        the function you differentiate (`has_aux=True`), then carry it:
        `state.replace(model_state=...)`.

        Raises:
            ConfigError: for a model `state.model()` did not give.
        """
        bound = self.env.bound.get(id(model))
        if bound is None:
            raise ConfigError(
                f"state.model_state_after takes a model state.model(params) gave; got "
                f"{type(model).__name__}."
            )
        return {**self.model_state, **bound.collected()}

    def apply_gradients(self, grads: Any, name: str | None = None, **extra_args: Any) -> StepState:
        r"""The state after one update of optimizer `name` (the task's one
        optimizer when `None`): `grads` (shaped as the parameters; of the
        whole batch, or averaged over the devices in the per-device form)
        applied to the parameters that optimizer trains
        (`TrainTask.trainable`); the others keep their values.

        `extra_args` go to an optimizer that reads more than the gradients,
        as optax's loops pass them (`value=loss` for reduce-on-plateau,
        `value_fn=` for L-BFGS, `obj_fn=` for Sophia); in the per-device
        form, numbers are averaged over the devices and functions refused.

        Raises:
            ConfigError: for a name the task's optimizers do not have.
        """
        env = self.env
        index = env.index(name)
        partition = env.partitions[index]
        optimizer = env.objective.parts[index].optimizer
        states, all_grads = (
            env.objective.of_parts(self.opt_state),
            env.objective.of_parts(self.grads),
        )
        _check_gradients(grads, self.params, name)
        trainable = partition.split(self.params)
        applied = partition.split(grads)
        if env.axis_name is not None:
            functions = [key for key, value in extra_args.items() if callable(value)]
            if functions:
                raise ConfigError(f"state.apply_gradients({functions[0]}=...): {PER_DEVICE}")
            applied = jax.lax.pmean(applied, env.axis_name)
            extra_args = pmean_floating(extra_args, env.axis_name)
        # materialized as the built-in step's are: the same bits in every variant
        applied = jax.lax.optimization_barrier(applied)
        updates, states[index] = optimizer_update(
            optimizer, applied, states[index], trainable, extra_args
        )
        # recorded in the parameters' dtypes: the state keeps its dtypes in a scan
        all_grads[index] = jax.tree.map(lambda g, p: g.astype(p.dtype), applied, trainable)
        return dataclasses.replace(
            self,
            params=partition.merge(self.params, optax.apply_updates(trainable, updates)),
            opt_state=env.objective.by_part(states),
            grads=env.objective.by_part(all_grads),
        )


def _check_gradients(grads: Any, params: Any, name: str | None) -> None:
    r"""A `ConfigError` (while tracing) unless `grads` is shaped as the
    parameters: the same tree, each leaf of its parameter's shape (a
    broadcastable one would train, wrongly)."""
    where = "state.apply_gradients" + ("" if name is None else f"(name={name!r})")
    wanted = jax.tree_util.tree_flatten_with_path(params)[0]
    given = jax.tree_util.tree_flatten_with_path(grads)[0]
    if jax.tree.structure(grads) != jax.tree.structure(params):  # type: ignore[operator]
        want = {"/".join(key_names(path)) for path, _ in wanted}
        have = {"/".join(key_names(path)) for path, _ in given}
        missing, unknown = sorted(want - have), sorted(have - want)
        raise ConfigError(
            f"{where}: the gradients must be a tree shaped as state.params (differentiate "
            f"with respect to state.params, or a value state.model(params) was given); "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            + (f", not parameters {unknown[:5]}" if unknown else "")
            + "."
        )
    for (path, parameter), (_, gradient) in zip(wanted, given):
        if jnp.shape(gradient) != jnp.shape(parameter):
            raise ConfigError(
                f"{where}: the gradient of {'/'.join(key_names(path))} has the shape "
                f"{tuple(jnp.shape(gradient))}; its parameter's is "
                f"{tuple(jnp.shape(parameter))}. A gradient has its parameter's shape."
            )


def own_step(
    update: UpdateFn,
    objective: Objective,
    carry: Any,
    axis_name: str | None,
    shards: NamedSharding | None = None,
    reads_data: bool = True,
) -> Step:
    r"""The step of `TrainTask(update=fn)`.

    Args:
        update: the task's `update(state, batch, *, rng, step)`.
        objective: the task's optimizers and trainable parts (and its model).
        carry: the initial arrays the step carries, or `None`.
        axis_name: the mesh axis gradients are averaged over (the
            per-device form, for a step that names the batch axis); `None`
            for the step of the whole batch, and with a sharded state
            (`shards`), whose per-device step runs as one program.
        shards: the batch's layout with a sharded state, or `None`.
        reads_data: whether the task has a data stream; without, `fn` is
            given `None` for the batch.
    """
    averaged_over = axis_name if shards is None else None
    partitions: list[Any] = []

    def step_update(fields: Fields, batch: Any, context: Context) -> tuple[Fields, Outcome]:
        params = fields["model_params"]
        if not partitions:
            partitions.extend(objective.partitions(params))
        device_index = jax.lax.axis_index(averaged_over) if averaged_over else 0
        number = context.step + 1  # keys count from 1, as the built-in step's
        env = _Env(
            objective,
            partitions,
            averaged_over,
            step_keys(context.key, number, device_index, objective.rng_labels),
            {} if context.frozen is None else context.frozen,
        )
        zeros = objective.by_part(
            [partition.split(jax.tree.map(jnp.zeros_like, params)) for partition in partitions]
        )
        state = StepState(
            params, fields["model_state"], fields["optimizer_state"], fields.get(CARRY), zeros, env
        )
        given = batch if objective.batch_tree is None else objective.batch_tree.unflatten(batch)
        if not reads_data:
            given = None
        rng = loss_key(context.key, number, device_index)
        result = update(state, given, rng=rng, step=context.step)
        new, loss, metrics = _checked(result, update, averaged_over is not None)
        for bound in env.bound.values():
            refuse_written(bound)  # a trained parameter assigned: the write would be lost
        if new.model_state is fields["model_state"]:  # the step left it: writes carry over
            new = dataclasses.replace(new, model_state=_written_state(env, new.model_state))
        if averaged_over is not None:
            loss, metrics = jax.lax.pmean((loss, metrics), averaged_over)
        new_fields = {
            **fields,
            "model_params": new.params,
            "model_state": _averaged(new.model_state, averaged_over),
            "optimizer_state": new.opt_state,
        }
        if carry is not None:
            new_fields[CARRY] = _averaged(new.carry, averaged_over)
        return new_fields, Outcome(loss, metrics, new.grads, jnp.isfinite(loss))

    transforms = [] if carry is None else [with_carry(carry)]
    if objective.frozen is not None:
        transforms.append(with_frozen(objective.frozen))
    return chain(Step(dict, step_update), *transforms)


def _written_state(env: _Env, given: Any) -> Any:
    r"""The model state as an NNX module `state.model()` gave left it (a
    non-parameter `nnx.Variable` the step wrote), as a `compute_loss`'s
    writes carry over; `given` if none wrote any.

    Raises:
        ConfigError: when several modules wrote theirs (which one to keep is
            the step's to say).
    """
    given_leaves = jax.tree.leaves(given)
    changed = []
    for bound in env.bound.values():
        if not isinstance(bound, BoundNNX):
            continue
        after = bound.state()
        leaves = jax.tree.leaves(after)
        if len(leaves) != len(given_leaves) or any(
            a is not b for a, b in zip(leaves, given_leaves)
        ):
            changed.append(after)
    if len(changed) > 1:
        raise ConfigError(
            "Several models state.model() gave wrote their non-parameter variables; "
            "say which state the step carries: return state.replace(model_state="
            "state.model_state_after(model)) for the model whose writes count."
        )
    return changed[0] if changed else given


def _averaged(tree: Any, axis_name: str | None) -> Any:
    r"""Floating leaves averaged over the devices (they stay one value for
    every replica); integer ones as they are."""
    return tree if axis_name is None else pmean_floating(tree, axis_name)


def _checked(
    result: Any, update: UpdateFn, per_device: bool
) -> tuple[StepState, jax.Array, dict[str, jax.Array]]:
    r"""What `update` returned, as `(state, loss, metrics)` (checked as a
    built-in step's loss is, `split_loss`), or a `ConfigError`/`LossError`
    naming what is wrong."""
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], StepState)):
        got = (
            f"a tuple of {len(result)}: ({', '.join(type(item).__name__ for item in result)})"
            if isinstance(result, tuple)
            else type(result).__name__
        )
        raise ConfigError(
            f"task.update must return (state, metrics): the StepState it was given "
            f"(or state.apply_gradients(...)/state.replace(...) of it) and a dict of "
            f"scalars with 'loss'; {_name(update)} returned {got}."
        )
    state, metrics = result
    if not isinstance(metrics, Mapping) or "loss" not in metrics:
        raise LossError(
            f"task.update's metrics must be a dict of scalars with 'loss' (the loss "
            f"the interval's mean, the non-finite check and the progress bar read); "
            f"{_name(update)} returned {metrics!r:.200}."
        )
    # the loss and the metrics as a built-in step's loss returns them
    others = {name: value for name, value in metrics.items() if name != "loss"}
    loss, checked = split_loss((metrics["loss"], others), per_device)
    return state, loss, checked


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def check_update(update: Any) -> None:
    r"""Checks that `update` takes `(state, batch, *, rng, step)`.

    Raises:
        ConfigError: naming what the signature lacks.
    """
    if not callable(update):
        raise ConfigError(f"task.update must be callable; got {update!r}.")
    try:
        signature = inspect.signature(update)
    except (TypeError, ValueError):
        return
    parameters = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    missing = [keyword for keyword in ("rng", "step") if keyword not in parameters]
    if missing:
        raise ConfigError(
            f"task.update must be update(state, batch, *, rng, step) -> (state, metrics); "
            f"{_name(update)} has the signature {signature} (missing {', '.join(missing)})."
        )
