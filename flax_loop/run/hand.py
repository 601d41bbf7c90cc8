r"""The caller's hand on the state between checkpoints: `update_state` and
`set_hyperparams`.

Between two checkpoints the caller may change what the loop carries: the
saved record (`SavedState`) comes out, a function changes it, and the
same structure, dtypes and shapes go back in before the next step, without
compiling the step again. `set_hyperparams` is one such change: the values
an `optax.inject_hyperparams` optimizer reads at its next update.

>>> import jax, optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop import TrainLoop, TrainTask
>>> model = nn.Dense(3)
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
>>> loop = TrainLoop(init=model.init, task=TrainTask(model.apply, optax.sgd(0.1),
...                  cross_entropy, batches), rnkey=jax.random.key(0), n_steps=4,
...                  stdout=False)
>>> _ = loop.next_checkpoint()
>>> loop.update_state(lambda saved: saved.map_arrays(
...     lambda arrays: {**arrays, "model_params": jax.tree.map(
...         np.zeros_like, arrays["model_params"])}))
>>> float(abs(loop.next_checkpoint().model_params["kernel"]).max()) < 0.1
True

>>> import jax.numpy as jnp
>>> state = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1).init({"w": jnp.ones(2)})
>>> halved = with_hyperparams(state, {"learning_rate": 0.05}, "task.optimizer")
>>> halved.hyperparams["learning_rate"].dtype, round(float(halved.hyperparams["learning_rate"]), 6)
(dtype('float32'), 0.05)
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from flax_loop.checkpoint import CheckpointFile, SavedState
from flax_loop.errors import ConfigError
from flax_loop.log import log
from flax_loop.parallel import key_names
from flax_loop.step.optimizer import step_arguments
from flax_loop.step.optimizer import update as optimizer_update

_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def changed_fields(
    saved: SavedState, fn: Callable[[SavedState], Any], shapes: dict[str, Any]
) -> dict[str, Any]:
    r"""The array fields of `fn(saved)`, checked against `shapes` (the
    state's fields: same structure, dtypes and shapes).

    Raises:
        ConfigError: naming what `fn` returned, or the first value whose
            structure, dtype or shape differs.
    """
    new = fn(saved)
    if not isinstance(new, SavedState):
        raise ConfigError(
            f"update_state's function must return the saved state it was given, "
            f"changed (saved.map_arrays(...), dataclasses.replace(saved, ...)); got "
            f"{type(new).__name__}."
        )
    arrays = {name: tree for name, tree in new.arrays().items() if name in shapes}
    if sorted(arrays) != sorted(shapes):
        raise ConfigError(
            f"update_state's function returned the fields {sorted(arrays)}; the state "
            f"has {sorted(shapes)}."
        )
    for name, tree in arrays.items():
        if jax.tree.structure(tree) != jax.tree.structure(shapes[name]):  # type: ignore[operator]
            raise ConfigError(
                f"update_state's function changed the structure of {name}: "
                f"{jax.tree.structure(shapes[name])} became {jax.tree.structure(tree)}."
            )
        for (path, want), have in zip(
            jax.tree_util.tree_flatten_with_path(shapes[name])[0], jax.tree.leaves(tree)
        ):
            if np.shape(have) != want.shape or _dtype(have) != want.dtype:
                where = "/".join((name, *key_names(path)))
                raise ConfigError(
                    f"update_state's function changed {where} from {want.dtype}"
                    f"{list(want.shape)} to {_dtype(have)}{list(np.shape(have))}; "
                    "a value keeps its dtype and shape (cast it: value.astype(old.dtype))."
                )
    return arrays


def changed_state(steps: Any, state: Any, step: int, fn: Callable[[SavedState], Any]) -> Any:
    r"""The state (as the compiled `steps` take it) after `fn` of its saved
    record at `step`, checked by `changed_fields`."""
    arrays = steps.copier()(state)
    saved = SavedState(None, None, None, step=step).with_arrays(arrays)
    return steps.with_fields(state, changed_fields(saved, fn, steps.state_shapes.fields))


def with_hyperparams(optimizer_state: Any, values: Mapping[str, Any], where: str) -> Any:
    r"""`optimizer_state` with the injected hyperparameters `values`, each
    in the dtype it had.

    Raises:
        ConfigError: if the state holds no `optax.inject_hyperparams` state,
            or none with one of the names.
    """
    found: set[str] = set()
    known: set[str] = set()

    def replaced(node: Any) -> Any:
        if not isinstance(node, _INJECTED):
            return node
        known.update(node.hyperparams)
        hyperparams = dict(node.hyperparams)
        for name, value in values.items():
            if name in hyperparams:
                old = hyperparams[name]
                hyperparams[name] = np.asarray(value, dtype=_dtype(old))
                found.add(name)
        return node._replace(hyperparams=hyperparams)

    new = jax.tree.map(replaced, optimizer_state, is_leaf=lambda node: isinstance(node, _INJECTED))
    if not known:
        raise ConfigError(
            f"set_hyperparams: {where} keeps no injected hyperparameters; build it "
            "with optax.inject_hyperparams, e.g. optax.inject_hyperparams(optax.adam)("
            "learning_rate=1e-3)."
        )
    unknown = sorted(set(values) - found)
    if unknown:
        raise ConfigError(
            f"set_hyperparams: {where} has no injected hyperparameter {unknown}; it has "
            f"{sorted(known)}."
        )
    return new


def _dtype(value: Any) -> np.dtype:
    dtype = getattr(value, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.result_type(value)


def constant_hyperparams(optimizer: Any) -> list[dict[str, Any]]:
    r"""The constant injected hyperparameters an optimizer starts with, one
    dict for each `optax.inject_hyperparams` state it holds, in order (those a
    schedule sets at every update are left out); `[]` when it holds none or
    cannot be probed.

    >>> constant_hyperparams(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    [{'learning_rate': Array(0.1, dtype=float32)}]
    >>> constant_hyperparams(optax.inject_hyperparams(optax.sgd)(
    ...     learning_rate=optax.linear_schedule(1.0, 0.0, 10)))
    [{}]
    """

    def is_injected(node: Any) -> bool:
        return isinstance(node, _INJECTED)

    try:
        state = optimizer.init({})
        # a constant stays what the state holds at an update; a schedule's is set anew
        probe = jax.tree.map(
            lambda node: (
                node._replace(
                    hyperparams={k: np.full_like(v, np.nan) for k, v in node.hyperparams.items()}
                )
                if is_injected(node)
                else node
            ),
            state,
            is_leaf=is_injected,
        )
        # optax's extra arguments for an optimizer that reads them (the loss)
        extra = step_arguments(np.float32(0.0), {}, lambda params: 0.0)
        _, updated = optimizer_update(optimizer, {}, probe, {}, extra)
    except Exception:  # an optimizer that cannot be probed on no parameters
        return []
    before = [n for n in jax.tree.leaves(state, is_leaf=is_injected) if is_injected(n)]
    after = [n for n in jax.tree.leaves(updated, is_leaf=is_injected) if is_injected(n)]
    return [
        {k: v for k, v in node.hyperparams.items() if np.isnan(np.asarray(later.hyperparams[k]))}
        for node, later in zip(before, after)
    ]


def scheduled_hyperparams(optimizer: Any) -> set[str]:
    r"""The injected hyperparameters of `optimizer` that a schedule sets at
    every update (empty when it holds none or cannot be probed).

    >>> scheduled_hyperparams(optax.inject_hyperparams(optax.sgd)(
    ...     learning_rate=optax.linear_schedule(1.0, 0.0, 10), momentum=0.9))
    {'learning_rate'}
    """
    constants = constant_hyperparams(optimizer)
    if not constants:
        return set()
    injected = [
        node
        for node in jax.tree.leaves(optimizer.init({}), is_leaf=lambda n: isinstance(n, _INJECTED))
        if isinstance(node, _INJECTED)
    ]
    return {
        hyperparameter
        for node, constant in zip(injected, constants)
        for hyperparameter in node.hyperparams
        if hyperparameter not in constant
    }


def task_hyperparams(optimizer_state: Any, optimizer: Any) -> tuple[Any, list[str]]:
    r"""A resumed optimizer state with the task's constant injected
    hyperparameters where the file holds others, and a description of each
    change (`"learning_rate 0.05 -> 0.1"`)."""
    injected = jax.tree.leaves(optimizer_state, is_leaf=lambda node: isinstance(node, _INJECTED))
    if not any(isinstance(node, _INJECTED) for node in injected):
        return optimizer_state, []  # (probing the optimizer runs its update)
    constants = constant_hyperparams(optimizer)
    nodes = iter(constants)
    changes: list[str] = []

    def replaced(node: Any) -> Any:
        if not isinstance(node, _INJECTED):
            return node
        wanted = next(nodes, {})
        hyperparams = dict(node.hyperparams)
        for name, value in wanted.items():
            stored = hyperparams.get(name)
            if stored is not None and not np.array_equal(np.asarray(stored), np.asarray(value)):
                changes.append(f"{name} {float(np.asarray(stored)):.6g} -> {float(value):.6g}")
                hyperparams[name] = np.asarray(value, dtype=_dtype(stored))
        return node._replace(hyperparams=hyperparams)

    if not constants:
        return optimizer_state, []
    new = jax.tree.map(replaced, optimizer_state, is_leaf=lambda node: isinstance(node, _INJECTED))
    return new, changes


def hyperparams_changer(
    optimizers: Mapping[str | None, Any], name: str | None, values: Mapping[str, Any]
) -> Callable[[SavedState], SavedState]:
    r"""`TrainLoop.set_hyperparams`' change of the saved state: the injected
    hyperparameters `values` of the optimizer `name` (of the task's
    `optimizers` by name; `{None: optimizer}` for one).

    Raises:
        ConfigError: for a `name` the task's optimizers do not have, or a
            hyperparameter a schedule sets at every step (the value set
            would be overwritten at the next step).
    """
    names = list(optimizers)
    if (name is None) != (names == [None]) or name not in names:
        raise ConfigError(
            f"set_hyperparams(name={name!r}): "
            + (
                "the task has one optimizer: leave name out."
                if names == [None]
                else f"the task's optimizers are {names}: name one."
            )
        )
    where = "task.optimizer" + ("" if name is None else f"[{name!r}]")
    scheduled = sorted(set(values) & scheduled_hyperparams(optimizers[name]))
    if scheduled:
        raise ConfigError(
            f"set_hyperparams: {where} sets {', '.join(scheduled)} from a schedule at "
            f"every step, which would overwrite the value set. Inject a constant "
            f"(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)) to set it from "
            "the loop, or change the schedule and build a new task."
        )

    def changed(saved: SavedState) -> SavedState:
        state = saved.optimizer_state
        if name is None:
            state = with_hyperparams(state, values, where)
        else:
            state = {**state, name: with_hyperparams(state[name], values, where)}
        return dataclasses.replace(saved, optimizer_state=state)

    return changed


def with_task_hyperparams(
    restored: CheckpointFile, optimizer: Any, keep: bool = False
) -> CheckpointFile:
    r"""The restored state with the task's constant injected hyperparameters
    (`optax.inject_hyperparams`) where the file holds others, or with the
    file's when `keep` (`TrainLoop(hyperparams="file")`: a rate the caller
    set survives a restart); said in one line either way."""
    parts = getattr(optimizer, "parts", None)
    if parts is None or restored.optimizer_state is None:
        return restored
    states = optimizer.of_parts(restored.optimizer_state)
    changed_states, changes = list(states), []
    for index, part in enumerate(parts):
        changed_states[index], changed = task_hyperparams(states[index], part.optimizer)
        changes += [f"{'' if part.name is None else part.name + ' '}{c}" for c in changed]
    if not changes:
        return restored
    if keep:
        log(
            f"{restored.path}'s injected hyperparameters differ from the task's: training "
            f"goes on with the file's, as hyperparams='file' asks ({', '.join(changes)}; "
            "the file's, then the task's).",
            lead="Resumed:",
        )
        return restored
    log(
        f"The task's injected hyperparameters differ from {restored.path}'s: training "
        f"goes on with the task's ({', '.join(changes)}; the file's -> the task's). "
        "TrainLoop(hyperparams='file') keeps the file's.",
        lead="Resumed:",
    )
    return dataclasses.replace(restored, optimizer_state=optimizer.by_part(changed_states))
