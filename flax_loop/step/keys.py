r"""What determines a program, as parts of a key: the task's objects by
identity (`identity`: its functions, the optimizer, as `jax.jit` keys a
function; plain values by value) and trees by their structure and each
leaf's shape, dtype, layout and weak type (`signature`). The step's forms
key their programs with them (`Objective.key`, `FrozenModels.key`); the
programs' cache (`flax_loop.programs.cache`) keeps the programs by them.

>>> import jax.numpy as jnp
>>> signature(jnp.ones(3)) == signature(jnp.zeros(3)), identity("adam")
(True, 'adam')
"""

import types
from collections.abc import Hashable, Mapping
from typing import Any

import jax
import numpy as np


class Identity:
    r"""An object compared by identity (and kept alive by the key that holds it)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def identity(value: Any) -> Hashable:
    r"""A key part for one of the task's objects: plain values by value,
    containers by their items, a bound method by its object and function,
    anything else by identity."""
    if value is None or isinstance(value, (str, int, float, bool, bytes)):
        return value
    if isinstance(value, types.MethodType):
        return ("method", Identity(value.__self__), Identity(value.__func__))
    if isinstance(value, Mapping):
        return ("map", tuple((identity(k), identity(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("seq", type(value).__name__, tuple(identity(item) for item in value))
    if isinstance(value, (jax.sharding.Sharding, jax.sharding.Mesh, jax.sharding.PartitionSpec)):
        return value  # compared by value
    return Identity(value)


def _leaf(leaf: Any) -> Hashable:
    if isinstance(leaf, jax.sharding.Sharding):  # a tree of shardings: each by value
        return leaf
    # dtypes compare and hash as they are (their names cost a set-up ~1 ms)
    dtype, shape = getattr(leaf, "dtype", None), getattr(leaf, "shape", None)
    if dtype is None or shape is None:
        value = np.asarray(leaf)
        dtype, shape = value.dtype, value.shape
    sharding = getattr(leaf, "sharding", None)
    return (tuple(shape), dtype, sharding, bool(getattr(leaf, "weak_type", False)))


def signature(tree: Any) -> Hashable:
    r"""A tree's structure and each leaf's shape, dtype, layout and weak
    type; a tree of shardings' structure and its shardings."""
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple(_leaf(leaf) for leaf in leaves))
