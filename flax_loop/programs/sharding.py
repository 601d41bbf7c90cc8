r"""Where the training state lives: replicated, FSDP, the model's own
annotations, or per-leaf specs on a mesh.

`TrainLoop(sharding=...)` takes one of four forms:

- `"replicated"`: every device holds the whole state (the default without
  a mesh, or with a mesh and a model without annotations).
- `"fsdp"`: every leaf of the parameters and the optimizer state of at least
  `fsdp_min_bytes` bytes is split along its largest dimension the number of
  devices divides; smaller leaves stay replicated.
- `"model"`: each parameter as the model annotates it (`nnx.with_partitioning`,
  linen's `nn.with_partitioning` or `nn.with_logical_partitioning`, logical
  names translated by flax's logical axis rules); the default with a mesh
  and an annotated model.
- a function `sharding(path, leaf) -> PartitionSpec` over the parameters
  (`path` is a tuple of the keys leading to the leaf, such as `("Dense_0",
  "kernel")`).

Except with `"fsdp"`, each optimizer-state leaf that mirrors a parameter
follows that parameter's layout.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> from flax_loop.parallel import Placement
>>> placement = Placement(jax.devices())
>>> params = {"big": jax.ShapeDtypeStruct((1024, 512), jnp.float32),
...           "small": jax.ShapeDtypeStruct((16,), jnp.float32)}
>>> specs = parameter_specs("fsdp", placement, params, fsdp_min_bytes=2**20)
>>> specs["small"]  # under fsdp_min_bytes: whole on every device
P()
>>> specs["big"] == (P("data") if len(jax.devices()) > 1 else P())  # split if several
True
"""

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from flax_loop.errors import ConfigError
from flax_loop.parallel import DATA_AXIS, Placement, key_names
from flax_loop.programs.state import TrainState
from flax_loop.step.core import Field

ShardingRule = Callable[[tuple[str, ...], Any], PartitionSpec]
r"""`rule(path, leaf) -> PartitionSpec`; the layout of one parameter."""

Sharding = str | ShardingRule
r"""`"replicated"`, `"fsdp"`, `"model"` or a `ShardingRule`."""

SHARDING_MODES = ("replicated", "fsdp", "model")

DEFAULT_FSDP_MIN_BYTES = 2**20
r"""With `"fsdp"`, leaves smaller than this (1 MiB) stay replicated; splitting
them saves little memory and costs a collective each step."""


def check_sharding(sharding: Any) -> Sharding | None:
    r"""The sharding argument (`None`: chosen from the mesh and the model),
    or a `ConfigError` saying what it may be."""
    if sharding is None or callable(sharding) or sharding in SHARDING_MODES:
        return sharding
    raise ConfigError(
        f"sharding must be 'replicated', 'fsdp', 'model' or a function (path, leaf) -> "
        f"PartitionSpec; got {sharding!r}."
    )


def chosen_sharding(sharding: Sharding | None, annotations: Any) -> Sharding:
    r"""The sharding a loop runs with: the given one, else `"model"` for an
    annotated model (`annotations` not `None`), else `"replicated"`.

    Raises:
        ConfigError: for `"model"` with a model that annotates no parameter.
    """
    if sharding is None:
        return "replicated" if annotations is None else "model"
    if sharding == "model" and annotations is None:
        raise ConfigError(
            "sharding='model' lays each parameter out as the model annotates it, but "
            "this model annotates none: annotate them (nnx.with_partitioning, "
            "nn.with_partitioning or nn.with_logical_partitioning), or pass "
            "sharding='replicated', 'fsdp' or a function (path, leaf) -> PartitionSpec."
        )
    return sharding


def linen_annotations(variables: Any) -> Any:
    r"""The `PartitionSpec` each linen parameter's annotation asks for (a tree
    of the unboxed parameters' structure), or `None` if none is annotated.

    `nn.with_partitioning` names mesh axes; `nn.with_logical_partitioning`
    names logical axes, translated by the rules in force (flax's
    `nn.logical_axis_rules` context, composed with the annotation's own).
    """
    from flax.core import meta, spmd

    def spec(leaf: Any) -> PartitionSpec:
        if not isinstance(leaf, meta.Partitioned):
            return PartitionSpec()
        given: Any = leaf.names
        if isinstance(given, jax.sharding.NamedSharding):  # as JAX's tutorials annotate
            given = given.spec
        names = tuple(given)
        if not hasattr(leaf, "rules"):  # nn.with_partitioning: mesh axes
            return PartitionSpec(*names)
        rules = spmd.composite_rules(spmd.get_logical_axis_rules(), leaf.rules or ())
        return PartitionSpec(*spmd.from_sharding_rules(names, rules))

    boxed = jax.tree.leaves(variables, is_leaf=meta.is_axis_metadata)
    if not any(isinstance(leaf, meta.Partitioned) for leaf in boxed):
        return None
    return jax.tree.map(spec, variables, is_leaf=meta.is_axis_metadata)


def is_replicated(sharding: Sharding) -> bool:
    r"""Whether every device holds the whole state."""
    return isinstance(sharding, str) and sharding == "replicated"


def fsdp_spec(
    shape: tuple[int, ...],
    itemsize: int,
    n_shards: int,
    min_bytes: int,
    axis_name: str = DATA_AXIS,
) -> PartitionSpec:
    r"""The FSDP layout of one leaf: split along its largest dimension that
    `n_shards` divides (over the mesh axis `axis_name`), if it holds at least
    `min_bytes`; else replicated."""
    if n_shards == 1 or math.prod(shape) * itemsize < min_bytes:
        return PartitionSpec()
    candidates = [axis for axis, size in enumerate(shape) if size % n_shards == 0]
    if not candidates:
        return PartitionSpec()
    axis = max(candidates, key=lambda axis: (shape[axis], -axis))
    return PartitionSpec(*([None] * axis), axis_name)


def parameter_specs(
    sharding: Sharding,
    placement: Placement,
    params: Any,
    fsdp_min_bytes: int,
    annotations: Any = None,
) -> Any:
    r"""A `PartitionSpec` per parameter leaf (a tree of the parameters' structure).

    `annotations` are the model's own specs (`"model"`), a tree of the
    parameters' structure.

    Raises:
        ConfigError: if a rule fails, returns something other than a
            `PartitionSpec`, or a rule or an annotation names an axis the
            mesh lacks or splits a dimension the axis size does not divide.
    """
    if is_replicated(sharding):
        return jax.tree.map(lambda _: PartitionSpec(), params)
    axis_name = placement.batch_axis
    n_shards = placement.mesh.shape[axis_name]
    if sharding == "fsdp":
        return jax.tree.map(
            lambda leaf: fsdp_spec(
                tuple(leaf.shape),
                np.dtype(leaf.dtype).itemsize,
                n_shards,
                fsdp_min_bytes,
                axis_name,
            ),
            params,
        )
    if sharding == "model":

        def annotated(path: tuple[Any, ...], leaf: Any, spec: PartitionSpec) -> PartitionSpec:
            names = key_names(path)
            _check_spec(spec, names, tuple(leaf.shape), placement.mesh, ANNOTATION)
            return spec

        return jax.tree_util.tree_map_with_path(annotated, params, annotations)

    def spec_of(path: tuple[Any, ...], leaf: Any) -> PartitionSpec:
        names = key_names(path)
        try:
            spec = sharding(names, leaf)  # type: ignore[operator]
        except Exception as error:
            raise ConfigError(
                f"the sharding function raised {type(error).__name__} for {'/'.join(names)}: "
                f"{error}"
            ) from None
        if spec is None:
            spec = PartitionSpec()
        _check_spec(spec, names, tuple(leaf.shape), placement.mesh, RULE)
        return spec

    return jax.tree_util.tree_map_with_path(spec_of, params)


RULE = "the sharding function returned"
ANNOTATION = "the model's annotation asks for"


def _check_spec(
    spec: Any, names: tuple[str, ...], shape: tuple[int, ...], mesh: jax.sharding.Mesh, said: str
) -> None:
    where = "/".join(names)
    if not isinstance(spec, PartitionSpec):
        raise ConfigError(
            f"{said} {spec!r} for {where}; return a "
            "jax.sharding.PartitionSpec (PartitionSpec() to replicate)."
        )
    if len(spec) > len(shape):
        raise ConfigError(
            f"{said} {spec} for {where} of shape {shape}: "
            "more entries than the leaf has dimensions."
        )
    used = [
        axis for axes in spec for axis in ((axes,) if isinstance(axes, str) else tuple(axes or ()))
    ]
    repeated = sorted({axis for axis in used if used.count(axis) > 1})
    if repeated:
        raise ConfigError(
            f"{said} {spec} for {where}: it lays {', '.join(map(repr, repeated))} over "
            "more than one dimension; a mesh axis splits one dimension of an array. "
            "Name it once (None for a dimension that is not split)."
        )
    for dimension, axes in enumerate(spec):
        names_here = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = 1
        for axis in names_here:
            if axis not in mesh.shape:
                remedy = (
                    " Pass TrainLoop a mesh with that axis (mesh=jax.make_mesh(...)), or "
                    "map a logical name onto the mesh's axes with flax's "
                    "nn.logical_axis_rules around the TrainLoop(...) call."
                    if said == ANNOTATION
                    else ""
                )
                raise ConfigError(
                    f"{said} {spec} for {where}, but the mesh "
                    f"has no axis {axis!r} (its axes: {tuple(mesh.axis_names)}).{remedy}"
                )
            size *= mesh.shape[axis]
        if shape[dimension] % size:
            raise ConfigError(
                f"{said} {spec} for {where} of shape {shape}: "
                f"dimension {dimension} ({shape[dimension]}) is not divisible by the "
                f"{size} devices of {names_here}."
            )


def state_shardings(
    sharding: Sharding,
    placement: Placement,
    state: TrainState,
    optimizer: Any,
    fsdp_min_bytes: int = DEFAULT_FSDP_MIN_BYTES,
    annotations: Any = None,
    declared: Mapping[str, Field] | None = None,
    batch_rows: Collection[int] = (),
) -> TrainState:
    r"""A `NamedSharding` for every leaf of the state (a `TrainState` of them).

    The fields a step `declared` (`flax_loop.step.Step.fields`) that mirror
    the parameters are laid out as the parameters; in those with rows of the
    batch (a carry), a leaf whose leading size is one of `batch_rows` (the
    global batch's leading sizes) is split with the batch; the others are
    replicated.

    The parameters get their specs. With `"fsdp"` every optimizer-state leaf
    gets the FSDP layout of its own shape (a moment is laid out as its
    parameter); with a rule or the model's `annotations`, each
    optimizer-state leaf that mirrors a parameter (Adam's moments, say) gets
    that parameter's. `optimizer` is
    an optax optimizer or an `Objective` (several optimizers, trainable parts). Everything else
    (the model's other collections, counters, step counts) is replicated.
    """
    mesh, replicated = placement.mesh, placement.replicated
    declared = declared or {}
    if is_replicated(sharding) and not any(field.rows_of_batch for field in declared.values()):
        return jax.tree.map(lambda _: replicated, state)  # (what the rules below give it)

    def named(specs: Any) -> Any:
        return jax.tree.map(
            lambda spec: NamedSharding(mesh, spec),
            specs,
            is_leaf=lambda node: isinstance(node, PartitionSpec),
        )

    params = named(
        parameter_specs(sharding, placement, state.model_params, fsdp_min_bytes, annotations)
    )
    if is_replicated(sharding):
        optimizer_state: Any = jax.tree.map(lambda _: replicated, state.optimizer_state)
    elif sharding == "fsdp":
        optimizer_state = named(
            parameter_specs("fsdp", placement, state.optimizer_state, fsdp_min_bytes)
        )
    elif hasattr(optimizer, "optimizer_shardings"):  # an Objective: each part's own
        optimizer_state = optimizer.optimizer_shardings(
            _follow_parameters, state.optimizer_state, state.model_params, params, replicated
        )
    else:
        optimizer_state = _follow_parameters(
            optimizer, state.optimizer_state, state.model_params, params, replicated
        )
    everything_else = jax.tree.map(lambda _: replicated, state)
    mirrors = {name: params for name, field in declared.items() if field.mirrors_params}
    rows = {
        name: jax.tree.map(lambda leaf: _with_the_batch(leaf, batch_rows, placement), tree)
        for name, tree in state.fields.items()
        if name in declared and declared[name].rows_of_batch
    }
    return everything_else._replace(
        fields={
            **everything_else.fields,
            "model_params": params,
            "optimizer_state": optimizer_state,
            **mirrors,
            **rows,
        }
    )


def _with_the_batch(leaf: Any, batch_rows: Collection[int], placement: Placement) -> Any:
    r"""The batch's layout for a leaf with a row per example of the batch
    (split where the batch is); replicated for any other leaf."""
    shape = tuple(getattr(leaf, "shape", ()))
    if shape and shape[0] in batch_rows and shape[0] % placement.n_shards == 0:
        return placement.batch_sharding
    return placement.replicated


def _follow_parameters(
    optimizer: optax.GradientTransformation,
    optimizer_state: Any,
    params: Any,
    shardings: Any,
    other: Any,
) -> Any:
    r"""The optimizer state's shardings: a mirrored parameter's, or `other`."""
    try:
        return optax.tree_map_params(
            optimizer,
            lambda _, sharding: sharding,
            optimizer_state,
            shardings,
            transform_non_params=lambda _: other,
        )
    except Exception:
        # An optimizer state tree_map_params cannot walk: a leaf shaped like
        # exactly one layout of parameters follows it.
        by_shape: dict[tuple[int, ...], set[Any]] = {}
        for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
            by_shape.setdefault(tuple(np.shape(leaf)), set()).add(sharding)

        def follow(leaf: Any) -> Any:
            found = by_shape.get(tuple(np.shape(leaf)), set())
            return next(iter(found)) if len(found) == 1 else other

        return jax.tree.map(follow, optimizer_state)
