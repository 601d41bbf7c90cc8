r"""The Orbax directory as flax_loop writes it: one folder a step holding the
arrays (`state`, Orbax's `StandardCheckpointHandler`) and flax_loop's
metadata (`meta`: step, metrics, run key, data state, msgpack in JSON);
reading a step's metadata and index, and checking them against the loop's
state; calling Orbax with its failures as `CheckpointError`s and its stray
asyncio tracebacks silenced. The writers and the reader (`_orbax`) build on it.
"""

import base64
import contextlib
import gc
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import jax
import msgpack
import numpy as np

from flax_loop.checkpoint._checkpoint import CheckpointFile, Saved
from flax_loop.checkpoint.format import key_data
from flax_loop.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
)
from flax_loop.parallel import key_names

FORMAT_NAME = "flax_loop.orbax"
FORMAT_VERSION = 1
STATE_ITEM, META_ITEM = "state", "meta"
PARTS = Saved.CORE


def orbax_module() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as error:  # pragma: no cover - orbax comes with flax
        raise ConfigError(
            "Orbax checkpoints need orbax-checkpoint: pip install 'flax_loop[orbax]'."
        ) from error
    return ocp


def open_manager(directory: str, keep: int | None, read_only: bool) -> Any:
    ocp = orbax_module()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        read_only=read_only,
        create=not read_only,
        save_interval_steps=0 if read_only else 1,
    )
    absl = logging.getLogger("absl")
    level = absl.level
    if read_only:  # Orbax warns that a reader's directory is read-only: it is meant to be
        absl.setLevel(logging.ERROR)
    try:
        return ocp.CheckpointManager(
            os.path.abspath(directory),
            options=options,
            item_handlers={
                STATE_ITEM: ocp.StandardCheckpointHandler(),
                META_ITEM: ocp.JsonCheckpointHandler(),
            },
        )
    finally:
        absl.setLevel(level)


@contextlib.contextmanager
def reading(directory: str) -> Iterator[Any]:
    r"""A read-only manager of the directory, closed after use (left to the
    garbage collector, its event loop was sometimes closed under a callback)."""
    manager = open_manager(directory, None, read_only=True)
    try:
        yield manager
    finally:
        manager.close()


def encode_meta(file: CheckpointFile) -> dict[str, Any]:
    meta: dict[str, Any] = {"step": int(file.step), "metrics": file.metrics or {}}
    if file.rnkey is not None:
        impl, data = key_data(file.rnkey)
        meta["rnkey"] = {"impl": impl, "data": np.asarray(data).tolist()}
    if file.data_state is not None:
        meta["data_state"] = file.data_state
    if file.caller_state:
        meta["caller_state"] = file.caller_state
    if file.optimizer_names is not None:
        meta["optimizers"] = list(file.optimizer_names)
    packed = msgpack.packb(meta, use_bin_type=True)
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "step": int(file.step),
        "meta": base64.b64encode(packed).decode(),
    }


def decode_meta(stored: Any, where: str) -> dict[str, Any]:
    try:
        if stored.get("format") != FORMAT_NAME:
            raise ValueError(f"format {stored.get('format')!r}")
        meta = msgpack.unpackb(base64.b64decode(stored["meta"]), strict_map_key=False)
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            raise ValueError("no step")
        return meta
    except Exception as error:
        raise CheckpointCorruptError(
            f"{where} is damaged: its flax_loop metadata cannot be read ({error})."
        ) from None


def read_orbax_step(
    directory: str, step: int, read_arrays: bool = False
) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], str]]]:
    r"""A step's flax_loop metadata and its arrays' paths, shapes and dtypes
    (from Orbax's index); with `read_arrays`, every array is read too (onto
    the first local device), so that a missing or truncated one shows.

    Raises:
        CheckpointCorruptError: if the metadata or the index cannot be read.
    """
    ocp = orbax_module()
    where = os.path.join(directory, str(step))
    with reading(directory) as manager:
        return _read_step(ocp, manager, where, step, read_arrays)


def _read_step(
    ocp: Any, manager: Any, where: str, step: int, read_arrays: bool
) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], str]]]:
    stored = manager.restore(step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))
    meta = decode_meta(stored[META_ITEM], where)
    meta["version"] = stored[META_ITEM].get("version")
    if meta["step"] != step:
        raise CheckpointCorruptError(
            f"{where} is damaged or renamed: its folder says step {step}, its "
            f"metadata step {meta['step']}."
        )
    index = manager.item_metadata(step)[STATE_ITEM]
    if index is None:
        raise CheckpointCorruptError(f"{where} is damaged: its array index cannot be read.")
    tree = getattr(index, "tree", index)
    if read_arrays:
        abstract = abstract_tree(
            jax.tree.map(
                lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype),
                tree,
                is_leaf=lambda node: hasattr(node, "shape"),
            )
        )
        manager.restore(
            step,
            args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract)}),
        )
    return meta, array_shapes(tree)


def abstract_tree(tree: Any) -> Any:
    r"""`jax.ShapeDtypeStruct` objects with shardings: where each restored array goes."""
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def abstract(leaf: Any) -> jax.ShapeDtypeStruct:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            sharding = default
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

    return jax.tree.map(abstract, tree)


def array_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda node: node is None or hasattr(node, "shape")
    )[0]
    return {
        "/".join(key_names(path)): (tuple(leaf.shape), np.dtype(leaf.dtype).name)
        for path, leaf in leaves
        if leaf is not None
    }


def check_compatible(metadata: Any, abstract: Any, where: str) -> None:
    r"""A `CheckpointMismatchError` naming the paths whose shapes or dtypes
    differ between the stored arrays and the loop's (before Orbax reads any)."""
    if metadata is None:
        return
    stored, wanted = array_shapes(getattr(metadata, "tree", metadata)), array_shapes(abstract)
    problems = [f"{path} is missing" for path in wanted if path not in stored]
    problems += [f"{path} is not in the loop's state" for path in stored if path not in wanted]
    problems += [
        f"{path}: stored {stored[path][0]} {stored[path][1]}, the loop's "
        f"{wanted[path][0]} {wanted[path][1]}"
        for path in wanted
        if path in stored and stored[path] != wanted[path]
    ]
    if problems:
        shown = "; ".join(problems[:6]) + (
            f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
        )
        raise CheckpointMismatchError(
            f"{where} holds another model or optimizer than the loop's ({shown}). Resume "
            "with the model and optimizer that wrote it, or write to a new directory."
        )


def restore_tree(restore: Any, where: str, abstract: Any, *args: Any, **kwargs: Any) -> Any:
    r"""Orbax's restore, with a mismatch of trees, shapes or dtypes reported as such."""
    try:
        return restore(*args, **kwargs)
    except (ValueError, KeyError, TypeError) as error:
        text = str(error)
        if any(word in text.lower() for word in ("shape", "structure", "dtype", "key", "tree")):
            raise CheckpointMismatchError(
                f"{where} holds another model or optimizer than the loop's: {text[:2000]} "
                "Resume with the model and optimizer that wrote it, or write to a new "
                "directory."
            ) from error
        raise


@contextlib.contextmanager
def quiet_async_failures() -> Iterator[None]:
    r"""While a damaged step is read, Orbax leaves the failures of its other
    reads in asyncio futures and coroutines nobody retrieves, which Python
    prints with their tracebacks when they are collected: the reader
    reports the step once, so those are dropped (collected here, while
    quiet)."""
    logger = logging.getLogger("asyncio")
    level, hook = logger.level, sys.unraisablehook
    logger.setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda unraisable: None  # "Exception ignored in: <coroutine ...>"
    try:
        yield
    finally:
        gc.collect()
        logger.setLevel(level)
        sys.unraisablehook = hook


def first_line(error: BaseException) -> str:
    r"""An error's first line, at most 300 characters (Orbax's hold whole
    TensorStore specs)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def orbax_call(doing: str, directory: str, function: Any, *args: Any) -> Any:
    r"""`function(*args)`, with Orbax's own failures as a `CheckpointError`."""
    try:
        return function(*args)
    except (CheckpointError, ConfigError):
        raise
    except Exception as error:
        raise CheckpointError(
            f"Orbax failed to {doing} {directory!r}: {type(error).__name__}: {error}. "
            "The steps already finished there are intact."
        ) from None
