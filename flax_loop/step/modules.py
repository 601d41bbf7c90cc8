r"""Flax NNX modules in the functional form the loop compiles.

An `nnx.Module` holds its variables. The loop splits it once, at set-up,
into a graph definition and plain nested dicts (parameters; other state such
as BatchNorm statistics), and merges them back into a module only inside
the compiled step, as Flax's own functional examples do: no object graph is
walked per step, and the caller's module never changes. `nnx.update(model,
checkpoint.model_params, checkpoint.model_state)` puts a checkpoint back.

Randomness: every RNG stream of the merged module is reseeded each step
with keys derived from the run's key, the step and the device, so devices
draw different dropout masks; a `__call__(self, x, rngs=None)` also gets an
`nnx.Rngs` of those keys.

>>> import numpy as np
>>> from flax import nnx
>>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
>>> functional = NNXModel(model, train=True)
>>> variables = functional.init(None, np.ones((1, 3)))
>>> sorted(variables["params"])
['bias', 'kernel']
>>> functional.apply(variables, np.ones((4, 3))).shape
(4, 2)
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
from flax.core.scope import CollectionFilter
from jax.sharding import AxisType, Mesh, NamedSharding

from flax_loop.errors import ConfigError

if TYPE_CHECKING:
    from flax import nnx

# flax.nnx is imported where an NNX module is used, never for a linen program:
# its import is a noticeable part of every process's start.

DEFAULT_STREAM = "default"
r"""The RNG label an NNX model's streams are reseeded from when none is named."""


def is_nnx(value: Any) -> bool:
    r"""Whether `value` is an NNX module (not a linen function): only if the
    program imported flax.nnx can it hold one."""
    imported = sys.modules.get("flax.nnx")
    return imported is not None and isinstance(value, imported.Module)


def _check_call_keywords(kind: type, parameters: Mapping[str, inspect.Parameter]) -> None:
    r"""A `ConfigError` for a module whose `__call__` needs a keyword that
    flax_loop does not give (say `train`)."""
    needed = [
        name
        for name, parameter in parameters.items()
        if parameter.default is inspect.Parameter.empty
        and name != "rngs"
        and (
            parameter.kind is inspect.Parameter.KEYWORD_ONLY
            # the NNX tutorials' `__call__(self, x, train)`: a mode as an input
            or name in _TRAINING_FLAGS + _EVALUATION_FLAGS
        )
    ]
    if needed:
        raise ConfigError(
            f"{kind.__name__}.__call__ requires the argument {', '.join(map(repr, needed))}: "
            "flax_loop calls an NNX module as module(*inputs) (with rngs= if it takes "
            "them), and sets its mode itself: module.train() while training, "
            "module.eval() in EvalLoop, which nnx.Dropout and nnx.BatchNorm follow. "
            "Drop the argument (the layers follow the mode), or give it the default that "
            "trains (train=True; a default of train=False keeps dropout off in training)."
        )


_TRAINING_FLAGS = ("train", "training", "is_training")  # off: evaluation mode
_EVALUATION_FLAGS = ("deterministic", "use_running_average", "inference", "eval")  # on


def evaluation_defaults(module: nnx.Module) -> list[str]:
    r"""The `__call__` arguments of a module holding `nnx.Dropout` or
    `nnx.BatchNorm` whose defaults put it in evaluation mode (`train=False`,
    `deterministic=True`, ...): called as `module(x)`, it trains with its
    dropout off (or its batch statistics frozen) whatever `module.train()`
    says.

    >>> from flax import nnx
    >>> class Net(nnx.Module):
    ...     def __init__(self):
    ...         self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
    ...     def __call__(self, x, train: bool = False):
    ...         return self.drop(x, deterministic=not train)
    >>> evaluation_defaults(Net())
    ['train=False']
    """
    from flax import nnx

    layers = [
        layer
        for _, layer in nnx.iter_graph(module)
        if isinstance(layer, (nnx.Dropout, nnx.BatchNorm))
    ]
    if not layers:
        return []
    parameters = inspect.signature(type(module).__call__).parameters
    return [
        f"{name}={parameter.default!r}"
        for name, parameter in parameters.items()
        if (name in _TRAINING_FLAGS and parameter.default is False)
        or (name in _EVALUATION_FLAGS and parameter.default is True)
    ]


class NNXModel:
    r"""An `nnx.Module` as linen-style `init` and `apply` functions.

    Args:
        module: the module; its current values are where training starts.
        train: whether `apply` runs it in training mode (`module.train()`:
            dropout on, batch statistics) or evaluation mode (`module.eval()`).
    """

    def __init__(self, module: nnx.Module, train: bool) -> None:
        from flax import nnx

        if nnx.state(module, nnx.Intermediate):  # values sown before: not state
            module = nnx.clone(module)
            nnx.pop(module, nnx.Intermediate)
        self.graphdef, params, self._rng_state, rest = _auto_typed(_split(module))
        self._params = nnx.to_pure_dict(params)
        self._rest = nnx.to_pure_dict(rest)
        self._templates = (params, rest)
        self._train = train
        parameters = inspect.signature(type(module).__call__).parameters
        self._takes_rngs = "rngs" in parameters
        _check_call_keywords(type(module), parameters)

    def init(self, rngs: Any, *inputs: Any, mutable: CollectionFilter = True) -> dict[str, Any]:
        r"""The module's current variables: `{"params": ..., **other state}`."""
        return {"params": self._params, **self._rest}

    def module(self, variables: Any) -> nnx.Module:
        r"""A new module holding `variables` (inside or outside compiled code)."""
        from flax import nnx

        variables = dict(variables)
        params = _state(self._templates[0], variables.pop("params"))
        rest = _state(self._templates[1], variables)
        rng_state = jax.tree.map(lambda leaf: leaf, self._rng_state)  # new variables, this trace's
        module = nnx.merge(self.graphdef, params, rng_state, rest)
        if self._train:
            module.train()
        else:
            module.eval()
        return module

    def apply(
        self,
        variables: Any,
        *inputs: Any,
        rngs: dict[str, jax.Array] | None = None,
        mutable: CollectionFilter = False,
    ) -> Any:
        r"""`module(*inputs)`, as linen's `apply`: the outputs, and with
        `mutable` the module's new state (`(outputs, {...})`)."""
        bound = self.bind(variables, rngs or {})
        outputs = bound.outputs(*inputs)
        return outputs if mutable in (False, None) else (outputs, bound.state())

    def annotations(self) -> Any:
        r"""The `PartitionSpec` each parameter's annotation asks for
        (`nnx.with_partitioning`; logical names translated by flax's logical
        axis rules in force), as a pure dict of the parameters' structure, or
        `None` if no parameter is annotated."""
        from flax import nnx

        variables = jax.tree.leaves(
            self._templates[0], is_leaf=lambda leaf: isinstance(leaf, nnx.Variable)
        )
        if not any(variable.get_metadata().get("out_sharding") for variable in variables):
            return None

        def as_names(variable: Any) -> Any:
            # JAX's tutorials annotate with a NamedSharding or a PartitionSpec:
            # their axis names are the annotation
            given = variable.get_metadata().get("out_sharding")
            if isinstance(given, jax.sharding.NamedSharding):
                given = given.spec
            if isinstance(given, jax.sharding.PartitionSpec):
                return variable.replace(out_sharding=tuple(given))
            return variable

        named = jax.tree.map(
            as_names, self._templates[0], is_leaf=lambda leaf: isinstance(leaf, nnx.Variable)
        )
        return nnx.to_pure_dict(nnx.get_partition_spec(named))

    @property
    def params_state(self) -> nnx.State:
        r"""the parameters as an `nnx.State` of variables (what NNX filters see)."""
        return self._templates[0]

    def bind(self, variables: Any, rngs: dict[str, jax.Array], carries: bool = True) -> BoundNNX:
        r"""A new module holding `variables`, its RNG streams reseeded from
        `rngs`; `carries`: whether the step carries its changed state."""
        module = self.module(variables)
        if rngs:
            _reseed(module, rngs.get(DEFAULT_STREAM, next(iter(rngs.values()))))
        bound = BoundNNX(module, rngs, self._takes_rngs, carries)
        bound.given = _param_leaves(module)
        return bound


class BoundNNX:
    r"""An NNX module of the step, holding the step's variables.

    Args:
        module: the module (`model` to a `compute_loss`).
        rngs: the step's keys by label.
        takes_rngs: whether the module's `__call__` takes `rngs=`.
        carries: whether the step carries the module's changed state.
    """

    def __init__(
        self, module: nnx.Module, rngs: dict[str, jax.Array], takes_rngs: bool, carries: bool
    ) -> None:
        self.model = module
        self._rngs, self._takes_rngs, self._carries = rngs, takes_rngs, carries
        self.given: dict[str, Any] = {}
        r"""the parameters' values the module was given, by path."""

    def written(self) -> list[str]:
        r"""The paths of the parameters a call assigned a new value (`param.value
        = ...` inside the loss): the step differentiates the values it gave
        and would drop such a write."""
        now = _param_leaves(self.model)
        return [path for path, value in self.given.items() if now.get(path) is not value]

    def outputs(self, *inputs: Any) -> Any:
        r"""`module(*inputs)` (with `rngs=nnx.Rngs(...)` if it takes them)."""
        from flax import nnx

        if self._takes_rngs and self._rngs:
            return self.model(*inputs, rngs=nnx.Rngs(**self._rngs))
        return self.model(*inputs)

    def state(self) -> Any:
        r"""The module's state but parameters, RNG streams and sown values, as
        a pure dict (what the step carries)."""
        from flax import nnx

        return nnx.to_pure_dict(_split(self.model)[3])

    def collected(self) -> Any:
        r"""What the step carries: the module's `state()`, if it carries any."""
        return self.state() if self._carries else {}


def _split(module: nnx.Module) -> tuple[Any, nnx.State, nnx.State, nnx.State]:
    r"""The graph definition, parameters, RNG state and other state of a
    module; values sown with `self.sow` (`nnx.Intermediate`) are left out."""
    from flax import nnx

    graphdef, params, rng_state, _, rest = nnx.split(  # type: ignore[misc]
        module, nnx.Param, nnx.RngState, nnx.Intermediate, ...
    )
    return graphdef, params, rng_state, rest


def _auto_typed(tree: Any) -> Any:
    r"""The tree with each array laid out on a mesh of `Explicit` axes (an
    annotated module built under `jax.set_mesh`) moved to the same layout on
    the mesh's `Auto` twin: compiled code then takes it as any array, on
    other devices too (an `Explicit` array's type names its mesh)."""

    def retype(leaf: Any) -> Any:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding) or (
            AxisType.Explicit not in sharding.mesh.axis_types
        ):
            return leaf
        mesh = sharding.mesh
        auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)
        return jax.device_put(leaf, NamedSharding(auto, sharding.spec))

    return jax.tree.map(retype, tree)


def _state(template: nnx.State, values: Any) -> nnx.State:
    from flax import nnx

    state = jax.tree.map(lambda leaf: leaf, template)  # a copy: templates stay as they are
    nnx.replace_by_pure_dict(state, values)
    return state


def _reseed(module: nnx.Module, key: jax.Array) -> None:
    r"""Gives every RNG stream of `module` a key of its own, derived from `key`."""
    from flax import nnx

    streams = [
        stream for _, stream in nnx.graph.iter_graph(module) if isinstance(stream, nnx.RngStream)
    ]
    for index, stream in enumerate(streams):
        stream.key.set_value(jax.random.fold_in(key, index))
        stream.count.set_value(jax.numpy.zeros(stream.count.shape, stream.count.dtype))


def as_init(model: Any) -> Any:
    r"""A linen-style `init`: the function itself, or an NNX module's values."""
    return NNXModel(model, train=True).init if is_nnx(model) else model


def as_apply(model: Any, train: bool) -> Any:
    r"""A linen-style `apply`: the function itself, or an NNX module's call
    in training (`train=True`) or evaluation mode."""
    return NNXModel(model, train).apply if is_nnx(model) else model


def _param_leaves(module: nnx.Module) -> dict[str, Any]:
    r"""A module's parameter values by path (`"linear/kernel"`)."""
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {
        "/".join(map(str, path)): leaf.get_value() if hasattr(leaf, "get_value") else leaf
        for path, leaf in flat
    }


def refuse_evaluation_defaults(module: Any) -> None:
    r"""A `ConfigError` for an NNX module that a supervised task's call,
    `module(*inputs)`, would run in evaluation mode (`evaluation_defaults`)."""
    flags = evaluation_defaults(module)
    if flags:
        raise ConfigError(
            f"{type(module).__name__}.__call__ defaults to evaluation mode ({', '.join(flags)}) "
            "and holds dropout or batch normalization: called as model(x) with a task's "
            "loss, it would train with dropout off, silently. flax_loop sets the mode "
            "itself (module.train() while training, module.eval() in EvalLoop), which "
            "nnx.Dropout and nnx.BatchNorm follow: drop the argument and let the layers "
            "follow the mode, or default it to training (train=True)."
        )
