r"""`CheckpointFile`, and writing one atomically to a directory."""

import os
import re
import secrets
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from flax import serialization

from flax_loop.checkpoint import _format
from flax_loop.checkpoint._checkpoint import Metrics
from flax_loop.checkpoint._names import SUFFIX, TEMPORARY_PREFIX, LeftOut
from flax_loop.checkpoint._saved import Saved
from flax_loop.errors import CheckpointCorruptError, CheckpointError
from flax_loop.random import key_data, key_from_data


@dataclass
class CheckpointFile(Saved):
    r"""What a checkpoint file holds: the saved state and its metrics.

    >>> import optax
    >>> import flax.linen as nn
    >>> from flax_loop import TrainLoop, TrainTask, CheckpointFileReader
    >>> import pathlib, tempfile
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> model = nn.Dense(3)
    >>> def cross_entropy(logits, labels):
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    >>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
    >>> checkpoint = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
    ...                       n_steps=2, stdout=False).next_checkpoint()
    >>> file = CheckpointFileReader(dir=str(tmp / "ckpts"), target=model.init).read_newest()
    >>> file is None    # the directory holds no checkpoint yet
    True
    """

    step: int
    r"""the step number at which this checkpoint occurred."""

    metrics: Metrics = field(default_factory=dict)
    r"""metrics at the checkpoint, by group (empty for a plain checkpoint)."""

    version: int = _format.FORMAT_VERSION
    r"""the file format version."""

    path: str | None = field(default=None, compare=False)
    r"""the file it was read from (`None` for one not read from a file)."""

    left_out: LeftOut | None = field(default=None, kw_only=True)
    r"""the frozen parameters this file leaves out (`CheckpointFileWriter(
    save_frozen=False)`): their paths and a digest of their values, which a
    resumed run takes from its initialization and checks; `None` when the
    file holds every parameter."""


def quote(name: str) -> str:
    r"""Encodes a group or metric name so that file names cannot collide."""
    return urllib.parse.quote(name, safe="").replace(".", "%2E")


def file_name(prefix: str, step: int) -> str:
    return f"{prefix}{step}{SUFFIX}"


def list_steps(directory: str, prefix: str) -> list[tuple[int, str]]:
    r"""`(step, path)` of the checkpoint files with `prefix`, newest first."""
    pattern = re.compile(rf"{re.escape(prefix)}(\d+){re.escape(SUFFIX)}")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except NotADirectoryError as error:
        raise CheckpointError(
            f"The checkpoint directory {directory!r} is a file; give a directory path."
        ) from error
    found = []
    for name in names:
        match = pattern.fullmatch(name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return sorted(found, reverse=True)


def _metrics_to_file(metrics: Any) -> dict[str, dict[str, float]]:
    def number(value: Any) -> Any:
        array = np.asarray(value)
        if array.size != 1:
            return array.tolist()
        return array.item()

    return {
        str(group): {str(name): number(value) for name, value in values.items()}
        for group, values in dict(metrics).items()
    }


def save(directory: str, prefix: str, file: CheckpointFile, fsync: bool = True) -> str:
    r"""Writes `file` atomically as `directory/prefix<step>.ckpt`.

    The bytes go to a temporary file in the same directory, which is flushed,
    fsynced and renamed over the final name; then the directory is fsynced.
    A crash leaves either the old state or the new file, never half a file.

    Returns:
        the path written.
    """
    ensure_directory(directory)
    # the array fields of the saved state; an absent one (no moving average) is left out
    tree = {
        name: serialization.to_state_dict(arrays)
        for name, arrays in file.arrays().items()
        if arrays is not None
    }
    meta: dict[str, Any] = {
        "step": int(file.step),
        "metrics": _metrics_to_file(file.metrics),
        "data_state": file.data_state,
    }
    if file.left_out is not None:
        meta["frozen"] = file.left_out.to_meta()
    if file.rnkey is not None:
        impl, data = key_data(file.rnkey)
        meta["rnkey"] = {"impl": impl, "data": data.tolist()}
    final = os.path.join(directory, file_name(prefix, int(file.step)))
    temporary = os.path.join(
        directory, f"{TEMPORARY_PREFIX}{file_name(prefix, int(file.step))}.{secrets.token_hex(4)}"
    )
    try:
        with open(temporary, "wb") as stream:
            try:
                _format.write(stream, tree, meta)
            except (TypeError, ValueError) as error:
                raise CheckpointError(
                    f"Cannot encode the checkpoint for {final}: {error}. The data "
                    "iterator's state and metrics must be plain numbers, strings, "
                    "bytes, lists and dicts."
                ) from error
            stream.flush()
            if fsync:
                os.fsync(stream.fileno())
        os.replace(temporary, final)
    except BaseException:
        remove_quietly(temporary)
        raise
    if fsync:
        _fsync_directory(directory)
    return final


def load(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    r"""Reads and verifies a checkpoint file: its state tree and its metadata."""
    return _format.read(path)


def restore_key(meta: dict[str, Any], path: str) -> jax.Array | None:
    r"""The run's key stored in a file's metadata, if any."""
    entry = meta.get("rnkey")
    if not isinstance(entry, dict):
        return None
    try:
        return key_from_data(str(entry.get("impl")), np.asarray(entry.get("data")))
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointCorruptError(
            f"{path} is damaged: its key cannot be rebuilt ({error})."
        ) from error


def clean_temporary(directory: str, prefix: str) -> None:
    r"""Removes temporary files that an interrupted write of `prefix` left.

    Only a writer that holds the directory's lock for `prefix` calls this:
    no other live writer then writes such files.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return
    start = TEMPORARY_PREFIX + prefix
    for name in names:
        if name.startswith(start) and re.fullmatch(
            rf"{re.escape(start)}\d+{re.escape(SUFFIX)}\.[0-9a-f]+", name
        ):
            remove_quietly(os.path.join(directory, name))


def ensure_directory(directory: str) -> None:
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(
            f"The checkpoint directory {directory!r} is a file; give a directory path."
        )
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise CheckpointError(
            f"Cannot create the checkpoint directory {directory!r}: {error}."
        ) from error
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"The checkpoint directory {directory!r} is not writable; fix its "
            "permissions or choose another output_dir."
        )


def _fsync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
