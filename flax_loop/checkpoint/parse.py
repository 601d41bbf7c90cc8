r"""Reading a checkpoint file (`format` lays it out): every field of its
footer is checked before it is used, and every array against its checksum.
"""

import errno
import math
import os
import stat
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import msgpack
import numpy as np

from flax_loop.checkpoint._names import array_names
from flax_loop.checkpoint.checksums import CHUNK, Checksums
from flax_loop.checkpoint.format import (
    _ARRAY_REF,
    _DTYPES,
    END_MAGIC,
    FORMAT_NAME,
    FORMAT_VERSION,
    HEAD,
    MAGIC,
    MAX_DEPTH,
    MAX_DIMENSIONS,
    MAX_EXTENT,
    MAX_STEP,
    TAIL,
)
from flax_loop.errors import CheckpointCorruptError, CheckpointVersionError


def read(path: str) -> tuple[Any, dict[str, Any]]:
    r"""Reads a checkpoint file, verifying every checksum.

    Returns:
        the tree (arrays as numpy) and the footer's metadata.

    Raises:
        CheckpointCorruptError: for a truncated or damaged file.
        CheckpointVersionError: for a file of a newer format version.
    """
    with _open_regular(path) as stream:
        footer, entries, data_end = read_footer(stream, path)
        names = array_names(footer.get("tree"))
        with Checksums() as checksums:
            arrays = [
                _read_array(stream, path, names.get(i, str(i)), entry, data_end, checksums)
                for i, entry in enumerate(entries)
            ]

    def resolve(code: int, data: bytes) -> Any:
        return arrays[_array_index(path, code, data, len(arrays))]

    tree = _resolve(footer.get("tree"), resolve)
    if not isinstance(tree, dict):
        raise CheckpointCorruptError(f"{path} is damaged: its state is not a map.")
    meta = {k: v for k, v in footer.items() if k not in ("tree", "arrays")}
    _check_meta(path, meta)
    return tree, meta


def read_footer(stream: BinaryIO, path: str) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    r"""A file's footer checked (header, end marker, footer checksum, layout):
    the footer, its array entries and where the arrays' data ends.

    Raises:
        CheckpointCorruptError: for a truncated or damaged file.
        CheckpointVersionError: for a file of a newer format version.
    """
    size = os.fstat(stream.fileno()).st_size
    if size < HEAD.size + TAIL.size:
        raise CheckpointCorruptError(
            f"{path} is truncated: {size} bytes, shorter than any checkpoint file."
        )
    magic, version = HEAD.unpack(stream.read(HEAD.size))
    if magic != MAGIC:
        raise CheckpointCorruptError(
            f"{path} is not a flax_loop checkpoint file (header {magic!r})."
        )
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{path} has format version {version}; this flax_loop reads "
            f"versions up to {FORMAT_VERSION}. Upgrade flax_loop to read it."
        )
    stream.seek(size - TAIL.size)
    footer_size, footer_crc, end = TAIL.unpack(stream.read(TAIL.size))
    data_end = size - TAIL.size - footer_size
    if end != END_MAGIC or footer_size > size - HEAD.size - TAIL.size:
        raise CheckpointCorruptError(
            f"{path} is truncated or damaged: its end marker or footer size is "
            "wrong (was the write interrupted?)."
        )
    stream.seek(data_end)
    footer_bytes = stream.read(footer_size)
    if zlib.crc32(footer_bytes) != footer_crc:
        raise CheckpointCorruptError(f"{path} is damaged: footer checksum mismatch.")
    footer = _unpack_footer(path, footer_bytes)
    _check_depth(path, footer)
    if footer.get("format") != FORMAT_NAME or footer.get("version") != version:
        raise CheckpointCorruptError(
            f"{path} has an inconsistent header: format {footer.get('format')!r} "
            f"version {footer.get('version')!r} against header version {version}."
        )
    entries = list(_entries(path, footer))
    _check_layout(path, entries, data_end)
    return footer, entries, data_end


def _open_regular(path: str) -> BinaryIO:
    r"""`path` opened for reading if it is a regular file (a symbolic link to
    one is followed); a FIFO, a device, a socket or a dangling link is a
    damaged checkpoint, found without blocking on it. The system's refusals
    (permissions, I/O, a folder) stay `OSError`s."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as error:  # a link to nothing
        what = (
            f"a symbolic link to {os.readlink(path)!r}, which does not exist"
            if os.path.islink(path)
            else error.strerror or str(error)
        )
        raise CheckpointCorruptError(f"{path} is not a checkpoint: {what}.") from error
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise CheckpointCorruptError(
            f"{path} is not a checkpoint: a symbolic link that loops (to {os.readlink(path)!r})."
        ) from error
    mode = os.fstat(descriptor).st_mode
    if stat.S_ISDIR(mode):  # the system's answer, as for any file it cannot read
        os.close(descriptor)
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise CheckpointCorruptError(
            f"{path} is not a checkpoint: it is not a regular file (mode {stat.filemode(mode)})."
        )
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def _check_layout(path: str, entries: list[dict[str, Any]], data_end: int) -> None:
    r"""Rejects a table whose arrays overlap (or claim more bytes than the file
    holds): a crafted table of many entries pointing at one valid block must
    not make a reader allocate many times the file's size."""
    spans = []
    for index, entry in enumerate(entries):
        offset, nbytes = entry.get("offset"), entry.get("nbytes")
        if isinstance(offset, int) and isinstance(nbytes, int) and nbytes > 0:
            spans.append((offset, offset + nbytes, index))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise CheckpointCorruptError(
                f"{path} is damaged: arrays {min(first, second)} and "
                f"{max(first, second)} overlap in the file."
            )
    if sum(end - start for start, end, _ in spans) > max(data_end - HEAD.size, 0):
        raise CheckpointCorruptError(
            f"{path} is damaged: its arrays claim more bytes than it holds."
        )


def _check_meta(path: str, meta: dict[str, Any]) -> None:
    step, metrics, key = meta.get("step"), meta.get("metrics", {}), meta.get("rnkey")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise CheckpointCorruptError(
            f"{path} is damaged: invalid step {step!r:.40} (an integer from 0 to {MAX_STEP})."
        )
    if not isinstance(metrics, dict) or not all(
        isinstance(group, dict) for group in metrics.values()
    ):
        raise CheckpointCorruptError(f"{path} is damaged: invalid metrics {metrics!r}.")
    if key is not None and not (
        isinstance(key, dict)
        and isinstance(key.get("impl"), str)
        and isinstance(key.get("data"), list)
        and all(isinstance(n, int) and 0 <= n < 2**32 for n in key["data"])
    ):
        raise CheckpointCorruptError(f"{path} is damaged: invalid key {key!r}.")


def _check_depth(path: str, footer: Any) -> None:
    r"""Rejects a footer nested deeper than `MAX_DEPTH`, without recursion:
    a map or list at depth `MAX_DEPTH` holds nothing (its values would lie
    deeper). Only maps and lists are visited (a footer's values are mostly
    numbers and names)."""
    stack = [(footer, 0)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value
        if children and depth >= MAX_DEPTH:
            raise CheckpointCorruptError(
                f"{path} is damaged: its metadata nests deeper than {MAX_DEPTH} levels."
            )
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _unpack_footer(path: str, data: bytes) -> dict[str, Any]:
    try:
        footer = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, RecursionError) as error:
        raise CheckpointCorruptError(
            f"{path} is damaged: its metadata cannot be decoded ({error})"
        ) from None
    if not isinstance(footer, dict):
        raise CheckpointCorruptError(f"{path} is damaged: metadata is not a map.")
    return footer


def _entries(path: str, footer: dict[str, Any]) -> Iterator[dict[str, Any]]:
    table = footer.get("arrays")
    if not isinstance(table, list):
        raise CheckpointCorruptError(f"{path} is damaged: no array table.")
    for entry in table:
        if not isinstance(entry, dict):
            raise CheckpointCorruptError(f"{path} is damaged: bad array entry.")
        yield entry


def _read_array(
    stream: BinaryIO,
    path: str,
    index: str,
    entry: dict[str, Any],
    data_end: int,
    checksums: Checksums,
) -> np.ndarray:
    dtype = _DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    shape = entry.get("shape")
    offset: Any = entry.get("offset")
    nbytes: Any = entry.get("nbytes")
    checksum: Any = entry.get("crc32")
    ints = (offset, nbytes, checksum)
    if (
        dtype is None
        or not isinstance(shape, list)
        or len(shape) > MAX_DIMENSIONS
        or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_EXTENT for n in shape
        )
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in ints)
    ):
        raise CheckpointCorruptError(
            f"{path} is damaged: array {index} has an invalid description {entry!r}."
        )
    expected = dtype.itemsize * math.prod(shape)  # Python's ints: no overflow
    if nbytes != expected or offset < HEAD.size or offset + nbytes > data_end:
        raise CheckpointCorruptError(
            f"{path} is damaged: array {index} ({dtype} {tuple(shape)}) claims "
            f"{nbytes} bytes at offset {offset}, outside the file's data."
        )
    array = np.empty(shape, dtype)
    stream.seek(offset)
    view = array.reshape(-1).view(np.uint8).data
    for start in range(0, nbytes, CHUNK):
        chunk = view[start : start + CHUNK]
        if stream.readinto(chunk) != len(chunk):  # type: ignore[attr-defined]
            checksums.result()  # drain what was queued for this array
            raise CheckpointCorruptError(f"{path} is truncated inside array {index}.")
        checksums.add(chunk)
    if checksums.result() != checksum:
        raise CheckpointCorruptError(
            f"{path} is damaged: array {index} ({dtype} {tuple(shape)}) fails its checksum."
        )
    return array


def _array_index(path: str, code: int, data: bytes, n_arrays: int) -> int:
    if code != _ARRAY_REF or len(data) != 4:
        raise CheckpointCorruptError(f"{path} is damaged: unknown tree element.")
    (index,) = struct.unpack("<I", data)
    if index >= n_arrays:
        raise CheckpointCorruptError(
            f"{path} is damaged: reference to array {index} of {n_arrays}."
        )
    return int(index)


def _resolve(tree: Any, resolve: Callable[[int, bytes], Any]) -> Any:
    if isinstance(tree, msgpack.ExtType):
        return resolve(tree.code, tree.data)
    if isinstance(tree, dict):
        return {key: _resolve(value, resolve) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_resolve(value, resolve) for value in tree]
    return tree
