r"""Frozen parameters left out of checkpoint files, and putting them back.

A run that trains a subset of its parameters (`TrainTask(trainable=...)`)
never changes the others. `CheckpointFileWriter(save_frozen=False)` leaves
them out of its files (a LoRA file holds the low-rank weights, not the
base): the file records their paths and a digest of their values. A run
resuming from it takes them from its own initialization and checks them
against the digest, so that a base that changed since (another seed,
another pretrained file) is an error, never a silent mix:

>>> import numpy as np
>>> params = {"base": {"kernel": np.ones((2, 2), np.float32)}, "lora": np.zeros(2, np.float32)}
>>> frozen = {"base": {"kernel": True}, "lora": False}
>>> kept, left_out = leave_out(params, frozen)
>>> kept, left_out.paths
({'lora': array([0., 0.], dtype=float32)}, ('/base/kernel',))
>>> left_out.digest == digest(flatten(params), left_out.paths)
True
>>> digest({"/base/kernel": np.full((2, 2), 2, np.float32)}, left_out.paths) == left_out.digest
False

The digest is computed where the arrays are (one compiled reduction, exact
in any order, so it does not depend on the layout or the number of devices)
and only 8 bytes per array come to the host.
"""

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from flax_loop.checkpoint._names import LeftOut
from flax_loop.errors import CheckpointMismatchError
from flax_loop.parallel import to_host


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    r"""`{path: leaf}` of nested dicts (as state dicts and files hold them)."""
    if isinstance(tree, dict) and tree:
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}/{key}"))
        return flat
    return {prefix or "/": tree}


def _without(tree: dict[str, Any], paths: set[str], prefix: str = "") -> dict[str, Any]:
    r"""The nested dict without the leaves at `paths` (nor the dicts they empty)."""
    kept = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}"
        if path in paths:
            continue
        if isinstance(value, dict) and value:
            value = _without(value, paths, path)
            if not value:
                continue
        kept[key] = value
    return kept


def frozen_paths(frozen: Any) -> tuple[str, ...]:
    r"""The paths of a mask's `True` leaves (the frozen parameters)."""
    flat = flatten(serialization.to_state_dict(frozen))
    return tuple(path for path, is_frozen in flat.items() if is_frozen is True)


def leave_out(params: Any, frozen: Any) -> tuple[dict[str, Any], "LeftOut"]:
    r"""The parameters' state dict without the frozen leaves, and what was left out."""
    paths = frozen_paths(frozen)
    tree = serialization.to_state_dict(params)
    return _without(tree, set(paths)), LeftOut(paths, digest(flatten(tree), paths))


def inserted(tree: Any, leaves: dict[str, Any]) -> dict[str, Any]:
    r"""A copy of a nested dict with `leaves` (`{path: leaf}`) added."""
    copy = dict(tree)
    for path, leaf in leaves.items():
        node = copy
        *parents, name = path.strip("/").split("/")
        for parent in parents:
            node[parent] = dict(node.get(parent) or {})
            node = node[parent]
        node[name] = leaf
    return copy


def taken_from(left_out: LeftOut, source: Any, origin: str) -> dict[str, Any]:
    r"""The left-out parameters' values in `source` (the run's initialized
    parameters), `{path: leaf}`, after checking them against the digest.

    Raises:
        CheckpointMismatchError: if `source` lacks them or holds other
            values than those the file's run trained with.
    """
    values = flatten(serialization.to_state_dict(source))
    if not set(left_out.paths) <= set(values) or digest(values, left_out.paths) != left_out.digest:
        shown = ", ".join(left_out.paths[:4]) + (", ..." if len(left_out.paths) > 4 else "")
        raise CheckpointMismatchError(
            f"{origin} left out {len(left_out.paths)} frozen parameters ({shown}), and "
            "this run's init gives them other values than the run that wrote it "
            "trained with. Initialize them as that run did (the same pretrained "
            "weights, the same rnkey), or resume from files written with "
            "save_frozen=True."
        )
    return {path: values[path] for path in left_out.paths}


def put_back(tree: Any, values: dict[str, Any]) -> Any:
    r"""`tree` (parameters restored from a file) with `values` (`{path: leaf}`)
    in place of the leaves the file left out."""
    return serialization.from_state_dict(tree, inserted(serialization.to_state_dict(tree), values))


def _as_words(leaf: jax.Array) -> jax.Array:
    r"""A leaf's bits as a flat vector of uint32 words."""
    if leaf.dtype == jnp.bool_:
        leaf = leaf.astype(jnp.uint8)
    width = leaf.dtype.itemsize
    if width == 8:
        return jax.lax.bitcast_convert_type(leaf, jnp.uint32).reshape(-1)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width]
    return jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32).reshape(-1)


@jax.jit
def _sums(leaves: list[jax.Array]) -> jax.Array:
    r"""Two position-weighted sums of each leaf's words, modulo 2**32: exact
    and independent of the order XLA reduces in."""
    rows = []
    for leaf in leaves:
        words = _as_words(leaf)
        index = jnp.arange(words.size, dtype=jnp.uint32)
        weights = index * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)
        mixed = (words ^ (words >> 15)) * jnp.uint32(0x85EBCA6B)
        rows.append(
            jnp.stack(
                [
                    jnp.sum(words * weights, dtype=jnp.uint32),
                    jnp.sum(mixed * (weights | jnp.uint32(1)) + index, dtype=jnp.uint32),
                ]
            )
        )
    return jnp.stack(rows)


def digest(flat: dict[str, Any], paths: Sequence[str]) -> str:
    r"""A digest of the values at `paths` of a flat state dict (`{path: leaf}`,
    as `flatten` gives it); shapes and dtypes included."""
    leaves = [flat[path] for path in paths]
    hasher = hashlib.sha256()
    for path, leaf in zip(paths, leaves):
        hasher.update(f"{path}:{np.dtype(leaf.dtype).name}{list(np.shape(leaf))};".encode())
    if leaves:
        # arrays split over several processes: every process computes it
        hasher.update(to_host(_sums([jnp.asarray(leaf) for leaf in leaves])).tobytes())
    return hasher.hexdigest()[:32]
