r"""Which parameters train: a mask over the parameters, and the trees it splits.

`TrainTask(trainable=...)` names the parameters an optimizer trains; the
others are frozen: they get no gradient, no optimizer state, and never
change. A `Partition` holds the mask (a tree of booleans shaped as the
parameters) and splits a tree into its trainable part, in which frozen
leaves are `None` (an empty subtree to JAX and optax: the optimizer's state
has no entry for them), and merges an updated part back.

>>> params = {"base": np.ones(3, np.float32), "lora": np.zeros(2, np.float32)}
>>> partition = Partition.of(lambda path, leaf: "lora" in path, params)
>>> partition.split(params)
{'base': None, 'lora': array([0., 0.], dtype=float32)}
>>> partition.n_trainable(params), partition.n_total(params)
(2, 5)

As a transform of a step (`train_only`), a partition gives the step it
wraps the trainable part as its `model_params` (its gradient, its
optimizer's update and state cover that part only) and `Context.whole` to
bind the model with all of them; the frozen leaves come back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from flax_loop.errors import ConfigError
from flax_loop.parallel import key_names
from flax_loop.step.core import Context, Fields, Outcome, Step, Transform

Filter = Any
r"""A filter of parameters; `filter(path, leaf) -> bool` (`path` the keys
leading to the leaf, such as `("Dense_0", "kernel")`), a string (the
parameters whose path holds that key), a list or tuple of filters (any of
them), or for an NNX module any NNX filter (a `Variable` type such as
`nnx.LoRAParam`, `nnx.PathContains`, ...)."""


def _is_none(node: Any) -> bool:
    return node is None


class Partition:
    r"""The trainable part of the parameters, by a mask of booleans.

    Args:
        mask: a tree of booleans shaped as the parameters; `None` trains all.
    """

    def __init__(self, mask: Any = None) -> None:
        self.mask = mask

    @classmethod
    def of(cls, trainable: Filter | None, params: Any, nnx_params: Any = None) -> Partition:
        r"""The partition a filter selects among `params`.

        Args:
            trainable: the filter; `None` trains every parameter.
            params: the parameters (arrays or shapes).
            nnx_params: an NNX module's parameters as an `nnx.State` of
                variables, whose pure dict is `params`: NNX filters see the
                variables.

        Raises:
            ConfigError: if the filter fails, or selects no parameter.
        """
        if trainable is None:
            return cls(None)
        try:
            if nnx_params is not None:
                mask = _nnx_mask(trainable, params, nnx_params)
            else:
                predicate = _predicate(trainable)
                mask = jax.tree_util.tree_map_with_path(
                    lambda path, leaf: bool(predicate(key_names(path), leaf)), params
                )
        except ConfigError:
            raise
        except Exception as error:
            raise ConfigError(
                f"the trainable filter {trainable!r} raised {type(error).__name__}: {error}"
            ) from error
        if not any(jax.tree.leaves(mask)):
            names = ["/".join(key_names(path)) for path, _ in _flat(params)]
            raise ConfigError(
                f"the trainable filter {trainable!r} selects none of the parameters "
                f"({', '.join(names[:8])}{', ...' if len(names) > 8 else ''}); "
                "check it against these paths."
            )
        return cls(None if all(jax.tree.leaves(mask)) else mask)

    @property
    def everything(self) -> bool:
        r"""whether every parameter trains."""
        return self.mask is None

    def frozen_mask(self) -> Any:
        r"""The mask's complement (`True` for a frozen parameter); `None`
        when every parameter trains."""
        if self.mask is None:
            return None
        return jax.tree.map(lambda keep: not keep, self.mask)

    def split(self, tree: Any) -> Any:
        r"""The trainable part of a tree shaped as the parameters (frozen leaves `None`)."""
        if self.mask is None:
            return tree
        return jax.tree.map(lambda leaf, keep: leaf if keep else None, tree, self.mask)

    def merge(self, tree: Any, part: Any) -> Any:
        r"""`tree` with the trainable leaves of `part` in place of its own."""
        if self.mask is None:
            return part
        return jax.tree.map(
            lambda new, old: old if new is None else new, part, tree, is_leaf=_is_none
        )

    def n_trainable(self, params: Any) -> int:
        r"""The number of trainable scalars."""
        return sum(int(np.size(leaf)) for leaf in jax.tree.leaves(self.split(params)))

    @staticmethod
    def n_total(params: Any) -> int:
        r"""The number of scalars of the parameters."""
        return sum(int(np.size(leaf)) for leaf in jax.tree.leaves(params))


def train_only(partition_of: Callable[[Any], Partition]) -> Transform:
    r"""The transform training the parameters `partition_of(params)` selects.

    The step it wraps sees the trainable part as its `model_params` (frozen
    leaves `None`), and `Context.whole` to complete it for the model; what
    it returns is merged back, so the frozen parameters stay as they were,
    bit for bit. `partition_of` is called while tracing (the parameters'
    shapes are known then).
    """

    def transform(step: Step) -> Step:
        def update(fields: Fields, batch: Any, context: Context) -> tuple[Fields, Outcome]:
            params = fields["model_params"]
            partition = partition_of(params)
            outer = context.whole

            def whole(trained: Any) -> Any:
                merged = partition.merge(params, trained)
                return merged if outer is None else outer(merged)

            inner = {**fields, "model_params": partition.split(params)}
            new, outcome = step.update(inner, batch, context._replace(whole=whole))
            return {**new, "model_params": partition.merge(params, new["model_params"])}, outcome

        return Step(step.init, update, step.fields)

    return transform


def union(partitions: Sequence[Partition], params: Any) -> Partition:
    r"""The parameters any of the partitions trains."""
    if any(partition.everything for partition in partitions):
        return Partition(None)
    masks = [partition.mask for partition in partitions]
    mask = jax.tree.map(lambda *keep: any(keep), *masks)
    return Partition(None if all(jax.tree.leaves(mask)) else mask)


def _flat(tree: Any) -> list[tuple[Any, Any]]:
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _predicate(trainable: Filter) -> Callable[[tuple[str, ...], Any], bool]:
    if isinstance(trainable, str):
        return lambda path, leaf: trainable in path
    if isinstance(trainable, (list, tuple)):
        predicates = [_predicate(item) for item in trainable]
        return lambda path, leaf: any(predicate(path, leaf) for predicate in predicates)
    if callable(trainable):
        return trainable
    raise ConfigError(
        f"trainable must be a function (path, leaf) -> bool, a key name, or a list of "
        f"them; got {trainable!r}."
    )


def _nnx_mask(trainable: Filter, params: Any, nnx_params: Any) -> Any:
    r"""The mask an NNX filter gives, shaped as the parameters' pure dict."""
    from flax import nnx

    def as_filter(item: Filter) -> Any:
        if isinstance(item, str):  # a path string, as for linen
            return nnx.PathContains(item)
        if isinstance(item, list):
            return nnx.Any(*(as_filter(each) for each in item))
        return item

    predicate = nnx.filterlib.to_predicate(as_filter(trainable))
    mask: dict[Any, Any] = {}
    for path, variable in nnx.to_flat_state(nnx_params):
        node = mask
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = bool(predicate(path, variable))
    if str(jax.tree.structure(mask)) != str(jax.tree.structure(params)):
        raise ConfigError(
            f"the trainable filter {trainable!r} could not be matched to the module's "
            "parameters; pass a function (path, leaf) -> bool instead."
        )
    return mask
