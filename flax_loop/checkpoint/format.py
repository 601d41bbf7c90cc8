r"""The checkpoint file: its name, its format (msgpack metadata, raw arrays,
checksums), and writing it atomically to a directory.

A file is laid out as::

    b"FLAXLOOP" | version: u32 | array bytes ... | footer | footer size: u64
                | footer crc32: u32 | b"POOLXALF"

The footer is a msgpack map: the format name and version, the step, the
metrics, the run's key, the data iterator's state, and a tree whose array
leaves are references (msgpack extension type 1) into a table of
`{dtype, shape, offset, nbytes, crc32}` entries. Arrays are written one at a
time, so writing holds at most one array's host copy beyond the state, and
nothing in a file is ever executed when it is read (`parse` reads a file,
every field checked before it is used).
"""

import os
import re
import secrets
import struct
import urllib.parse
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import ml_dtypes
import msgpack
import numpy as np

from flax_loop.checkpoint._names import FORMAT_VERSION, SUFFIX, TEMPORARY_PREFIX
from flax_loop.checkpoint.checksums import CHUNK, Checksums
from flax_loop.errors import CheckpointCorruptError, CheckpointError

if TYPE_CHECKING:
    import jax

    from flax_loop.checkpoint._checkpoint import CheckpointFile

FORMAT_NAME = "flax_loop.checkpoint"
MAGIC = b"FLAXLOOP"
END_MAGIC = b"POOLXALF"
HEAD = struct.Struct("<8sI")
TAIL = struct.Struct("<QI8s")
_ARRAY_REF = 1
MAX_DEPTH = 64
r"""The deepest nesting a file's tree or metadata may have (real states nest < 20)."""
MAX_STEP = 2**31 - 1
r"""The largest step a file may hold; the loop counts steps in an int32."""
MAX_DIMENSIONS = 32
r"""The most dimensions an array of a file may have (numpy's limit is 64)."""
MAX_EXTENT = 2**62
r"""The largest extent of one dimension that a file may claim."""


_DTYPES = {
    name: np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
_DTYPES.update(
    bfloat16=np.dtype(ml_dtypes.bfloat16),
    float8_e4m3fn=np.dtype(ml_dtypes.float8_e4m3fn),
    float8_e5m2=np.dtype(ml_dtypes.float8_e5m2),
)


def _host_leaf(leaf: Any) -> np.ndarray:
    from flax_loop.parallel import to_host  # JAX only where arrays are written

    array = to_host(leaf)
    if array.dtype.name not in _DTYPES:
        raise CheckpointError(
            f"Cannot write an array of dtype {array.dtype} to a checkpoint file; "
            f"supported dtypes are {sorted(_DTYPES)}."
        )
    # not np.ascontiguousarray: it turns a scalar into shape (1,)
    return array if array.flags.c_contiguous else array.copy(order="C")


def write(stream: BinaryIO, tree: Any, meta: dict[str, Any]) -> None:
    r"""Writes `tree` (nested dicts and lists of arrays) and `meta` to a stream.

    Args:
        stream: a binary file opened for writing, positioned at its start.
        tree: nested dicts/lists whose leaves are arrays or numbers.
        meta: msgpack-able metadata (step, metrics, ...).
    """
    stream.write(HEAD.pack(MAGIC, FORMAT_VERSION))
    table: list[dict[str, Any]] = []
    offset = HEAD.size

    def store(leaf: Any) -> msgpack.ExtType:
        nonlocal offset
        array = _host_leaf(leaf)
        view = array.reshape(-1).view(np.uint8).data
        for start in range(0, len(view), CHUNK):
            chunk = view[start : start + CHUNK]
            checksums.add(chunk)
            stream.write(chunk)
        table.append(
            {
                "dtype": array.dtype.name,
                "shape": list(array.shape),
                "offset": offset,
                "nbytes": array.nbytes,
                "crc32": checksums.result(),
            }
        )
        offset += array.nbytes
        return msgpack.ExtType(_ARRAY_REF, struct.pack("<I", len(table) - 1))

    with Checksums() as checksums:
        encoded = _map_leaves(tree, store)
    footer = msgpack.packb(
        {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "arrays": table,
            "tree": encoded,
            **meta,
        },
        use_bin_type=True,
    )
    stream.write(footer)
    stream.write(TAIL.pack(len(footer), zlib.crc32(footer), END_MAGIC))


def _map_leaves(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, dict):
        for key in tree:
            if not isinstance(key, str):
                raise CheckpointError(f"Checkpoint trees need string keys; got key {key!r}.")
        return {key: _map_leaves(value, fn) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_map_leaves(value, fn) for value in tree]
    if tree is None:
        return None
    return fn(tree)


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


WRITTEN: list[str] = []
r"""The newest checkpoint this process wrote (a file, or an Orbax step), for
messages that tell a user where a run again resumes from; empty if none."""


def save(directory: str, prefix: str, file: "CheckpointFile", fsync: bool = True) -> str:
    r"""Writes `file` atomically as `directory/prefix<step>.ckpt`.

    The bytes go to a temporary file in the same directory, which is flushed,
    fsynced and renamed over the final name; then the directory is fsynced.
    A crash leaves either the old state or the new file, never half a file.

    Returns:
        the path written.
    """
    ensure_directory(directory)
    # the array fields of the saved state; an absent one (no moving average) is left out
    from flax import serialization  # JAX only where a file is written

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
    if file.caller_state:
        meta["caller_state"] = file.caller_state
    if file.left_out is not None:
        meta["frozen"] = file.left_out.to_meta()
    if file.optimizer_names is not None:
        meta["optimizers"] = list(file.optimizer_names)
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
                write(stream, tree, meta)
            except (TypeError, ValueError) as error:
                raise CheckpointError(
                    f"Cannot encode the checkpoint for {final}: {error}. The data "
                    "iterator's state, the metrics and loop.caller_state must be "
                    "plain numbers, strings, bytes, lists and dicts."
                ) from None
            stream.flush()
            if fsync:
                os.fsync(stream.fileno())
        os.replace(temporary, final)
    except BaseException:
        remove_quietly(temporary)
        raise
    if fsync:
        _fsync_directory(directory)
    WRITTEN[:] = [final]
    return final


def key_data(key: Any) -> tuple[str, Any]:
    r"""The implementation name and raw data of a typed key, as saved."""
    import jax  # only where a key is saved or restored: listings load no JAX
    import numpy as np

    impl = str(jax.random.key_impl(key))
    return impl, np.asarray(jax.random.key_data(key))


def key_from_data(impl: str, data: Any) -> Any:
    r"""Rebuilds a typed key from `key_data`'s output."""
    import jax
    import numpy as np

    # the data cast on the host (a cast on the device compiles a program),
    # which `wrap_key_data` takes as it is
    host = cast("jax.Array", np.asarray(data, np.uint32))
    return jax.random.wrap_key_data(host, impl=impl)


def restore_key(meta: dict[str, Any], path: str) -> "jax.Array | None":
    r"""The run's key stored in a file's metadata, if any."""
    entry = meta.get("rnkey")
    if not isinstance(entry, dict):
        return None
    try:
        return key_from_data(str(entry.get("impl")), np.asarray(entry.get("data")))
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointCorruptError(
            f"{path} is damaged: its key cannot be rebuilt ({error})."
        ) from None


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
        ) from None
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
