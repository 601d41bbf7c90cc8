r"""Several models trained together: `TrainTask(apply={"generator": g, "critic": d})`.

The models of a dict become one model whose variables are dicts by model
name, `{"params": {"generator": ..., "critic": ...}, "batch_stats":
{"critic": ...}}`, so everything around the step (placement, files, the
memory plan, resuming) sees one tree. NNX modules become one `nnx.Dict`;
linen models stay apart (`LinenModels`: `init` calls each model's, a loss
gets each bound to its share). A loss (`compute_loss`, or `state.model()`
in a task's own step) gets the models as a dict by name; an optimizer of a
dict whose name is a model's trains that model by default (`ByModel`).

>>> import jax
>>> import numpy as np
>>> import flax.linen as nn
>>> generator, critic = nn.Dense(4), nn.Dense(1)
>>> init = as_init({"generator": generator.init, "critic": critic.init})
>>> variables = init({"params": jax.random.key(0)},
...                  {"generator": (np.ones((2, 3)),), "critic": (np.ones((2, 4)),)})
>>> jax.tree.map(np.shape, variables["params"]["critic"])
{'bias': (1,), 'kernel': (4, 1)}
>>> ByModel("critic")(("critic", "kernel"), None), ByModel("critic")(("generator", "bias"), None)
(True, False)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax.core.scope import CollectionFilter

from flax_loop.errors import ConfigError
from flax_loop.step.model import LinenModel
from flax_loop.step.modules import is_nnx


def is_several(value: Any) -> bool:
    r"""Whether `value` is a dict of models (an `nnx.Dict` is one module)."""
    return isinstance(value, Mapping) and not is_nnx(value)


@dataclasses.dataclass(frozen=True)
class ModelKind:
    r"""What a task's model is, settled once where the task comes in
    (`check_train_task`): NNX modules or linen apply functions, one model or
    several by name. Set-up asks it, not the model again.

    >>> import flax.linen as nn
    >>> ModelKind.of({"generator": nn.Dense(4).apply, "critic": nn.Dense(1).apply})
    ModelKind(nnx=False, names=('generator', 'critic'))
    """

    nnx: bool
    r"""whether the model is an NNX module (or each of several is)."""

    names: tuple[str, ...] | None = None
    r"""several models' names, in order; `None` for one model."""

    @property
    def several(self) -> bool:
        r"""whether the task trains several models (a dict by name)."""
        return self.names is not None

    @classmethod
    def of(cls, apply: Any) -> ModelKind:
        r"""The kind of `apply` (a model, or a dict of them)."""
        if is_several(apply):
            return cls(all(is_nnx(model) for model in apply.values()), tuple(apply))
        return cls(is_nnx(apply))

    def as_one(self, apply: Any) -> Any:
        r"""The model as the step uses it: several NNX modules as one
        `nnx.Dict`, anything else as it is (the model is not asked again)."""
        return _one_module(apply) if self.several and self.nnx else apply


def check_models(models: Mapping[str, Any], where: str) -> None:
    r"""Checks a dict of models: names that are identifiers, values all NNX
    modules or all apply functions.

    Raises:
        ConfigError: naming the bad name or value.
    """
    if not models:
        raise ConfigError(f"{where} is an empty dict; give the models by name.")
    for name in models:
        if not (isinstance(name, str) and name.isidentifier()):
            raise ConfigError(
                f"{where} names a model {name!r}: the names of several models are "
                "identifiers, such as 'generator' and 'critic'."
            )
    nnx = [is_nnx(model) for model in models.values()]
    if any(nnx) and not all(nnx):
        raise ConfigError(
            f"{where} mixes NNX modules and linen apply functions "
            f"({', '.join(f'{k}: {type(v).__name__}' for k, v in models.items())}); "
            "give them all as NNX modules or all as apply functions."
        )
    for name, model in models.items():
        if not (is_nnx(model) or callable(model)):
            raise ConfigError(
                f"{where}[{name!r}] must be an NNX module or a linen apply function; got {model!r}."
            )


def _one_module(modules: Mapping[str, Any]) -> Any:
    r"""NNX modules by name as one `nnx.Dict`."""
    from flax import nnx

    return nnx.Dict(**modules)


def as_init(inits: Any) -> Any:
    r"""A dict of models' `init`s (or NNX modules) as one linen-style `init`
    over a dict of each model's inputs; anything else as it is."""
    if not is_several(inits):
        return inits
    check_models(inits, "init")
    if all(is_nnx(model) for model in inits.values()):
        return _one_module(inits)
    return _SeveralInit(dict(inits))


@dataclasses.dataclass(frozen=True)
class _SeveralInit:
    r"""`init(rngs, inputs, mutable=...)`: each model's `init` with its own
    inputs (`inputs[name]`) and keys (the given ones folded with the model's
    index), the variables merged by collection, then by model."""

    inits: dict[str, Callable[..., Any]]

    def __call__(self, rngs: Any, inputs: Any = None, mutable: CollectionFilter = True) -> Any:
        if not isinstance(inputs, Mapping) or set(inputs) != set(self.inits):
            raise ConfigError(
                f"Several models are initialized each with its own inputs: pass "
                f"TrainLoop(..., input_sample={{name: inputs}}) for the models "
                f"{list(self.inits)}; got {type(inputs).__name__}"
                f"{' ' + str(list(inputs)) if isinstance(inputs, Mapping) else ''}."
            )
        merged: dict[str, dict[str, Any]] = {}
        for index, (name, init) in enumerate(self.inits.items()):
            keys = {label: jax.random.fold_in(key, index) for label, key in dict(rngs).items()}
            given = inputs[name] if isinstance(inputs[name], tuple) else (inputs[name],)
            for collection, value in dict(init(keys, *given, mutable=mutable)).items():
                merged.setdefault(collection, {})[name] = value
        return merged


class LinenModels:
    r"""Several linen models bound to the step's variables: `model` is a
    dict by name of `LinenModel`s, each holding its share of the variables
    and its own keys."""

    def __init__(
        self,
        applies: Mapping[str, Callable[..., Any]],
        params: Mapping[str, Any],
        state: Mapping[str, Any],
        rngs: dict[str, jax.Array],
        mutable: CollectionFilter,
    ) -> None:
        self.model = {
            name: LinenModel(
                apply,
                params[name],
                {c: held[name] for c, held in state.items() if name in held},
                {label: jax.random.fold_in(key, index) for label, key in rngs.items()},
                mutable,
            )
            for index, (name, apply) in enumerate(applies.items())
        }

    def outputs(self, *inputs: Any) -> Any:
        raise ConfigError(
            "A task of several models computes its loss itself: give compute_loss(model, "
            "batch, *, rng, step) (model a dict by name) or update, not loss."
        )

    def collected(self) -> dict[str, Any]:
        r"""The collections some model's calls changed, by collection then
        model (every model's share of them, changed or not)."""
        changed = {c for model in self.model.values() for c in model.collected()}
        return {
            collection: {
                name: model.state[collection]
                for name, model in self.model.items()
                if collection in model.state
            }
            for collection in sorted(changed)
        }


@dataclasses.dataclass(frozen=True)
class ByModel:
    r"""The trainable filter of one model of several: its parameters (the
    default of an optimizer named as a model)."""

    name: str

    def __call__(self, path: tuple[Any, ...], leaf: Any) -> bool:
        return bool(path) and str(getattr(path[0], "key", path[0])) == self.name


by_model = functools.cache(ByModel)
r"""`ByModel(name)`, one object a name; a re-run's programs are found again
(`programs/cache` keys a filter by identity)."""


def default_trainable(task: Any, kind: ModelKind) -> Any:
    r"""`task.trainable`, or for several models and a dict of optimizers
    named as models, each optimizer's model (`ByModel`)."""
    trainable = getattr(task, "trainable", None)
    if trainable is not None or not trains_by_model(task, kind):
        return trainable
    return {name: by_model(name) for name in task.optimizer}


def trains_by_model(task: Any, kind: ModelKind) -> bool:
    r"""Whether each optimizer of the task's dict is named as one of its models."""
    optimizer = getattr(task, "optimizer", None)
    if kind.names is None or not isinstance(optimizer, Mapping):
        return False
    return all(name in kind.names for name in optimizer)
