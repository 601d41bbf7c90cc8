r"""What a checkpoint directory holds: each checkpoint, its kind, and whether it is intact.

The answers `flax-loop ls`, `verify` and `show` print, for programs too:

>>> import jax
>>> import optax
>>> import flax.linen as nn
>>> from flax_loop import TrainLoop, TrainTask, CheckpointFileWriter
>>> import pathlib, tempfile
>>> tmp = pathlib.Path(tempfile.mkdtemp())
>>> model = nn.Dense(3)
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
>>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
>>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0), n_steps=4,
...                  n_steps_per_checkpoint=3, stdout=False)
>>> with CheckpointFileWriter(output_dir=str(tmp / "ckpts"), keep=2) as writer:
...     for checkpoint in loop:
...         _ = writer(checkpoint)
>>> [(entry.name, entry.status, entry.resume) for entry in list_checkpoints(str(tmp / "ckpts"))]
[('regular.3.ckpt', 'intact', False), ('regular.4.ckpt', 'intact', True)]
"""

import errno
import os
import re
import stat
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flax_loop.checkpoint import parse
from flax_loop.checkpoint._names import SUFFIX, TEMPORARY_PREFIX, LeftOut, array_names
from flax_loop.checkpoint.checksums import Checksums
from flax_loop.errors import CheckpointCorruptError, CheckpointError, FlaxLoopError

_STEP_NAME = re.compile(r"[0-9]+")
r"""An Orbax step folder's name (ASCII digits; `int` reads "²" as no number)."""

_FILE_NAME = re.compile(
    r"(?P<kind>regular|lowest|highest)\.(?:(?P<group>[^.]+)\.(?P<metric>[^.]+)\.)?(?P<step>\d+)"
    + re.escape(SUFFIX)
)


@dataclass
class CheckpointEntry:
    r"""One checkpoint of a directory: a file, or an Orbax step folder."""

    path: str
    r"""where it is."""

    kind: str
    r"""`"regular"`, `"lowest"`, `"highest"` (best-metric files) or `"orbax"`."""

    step: int
    r"""the step its name gives."""

    size: int
    r"""its size in bytes."""

    modified: float
    r"""when it was written (seconds since the epoch)."""

    status: str = "intact"
    r"""`"intact"`, `"damaged"` (a checksum, its format or its name is wrong),
    `"unreadable"` (the system refused to read it: permissions, I/O) or
    `"incomplete"` (an Orbax step folder that an interrupted write or
    pruning left without one of its items; a resume skips it)."""

    problem: str = ""
    r"""why it is not intact."""

    metric: str = ""
    r"""for best-metric files, `group/metric`."""

    resume: bool = False
    r"""whether a resume (`CheckpointFileReader`, `OrbaxCheckpointReader`) reads it."""

    @property
    def name(self) -> str:
        r"""its file or folder name."""
        return os.path.basename(self.path)

    @property
    def intact(self) -> bool:
        r"""whether it can be read."""
        return self.status == "intact"


@dataclass
class CheckpointContents:
    r"""What one checkpoint holds (`flax-loop show`)."""

    path: str
    step: int
    version: int
    metrics: Any
    has_rnkey: bool
    data_state: Any
    arrays: list[tuple[str, tuple[int, ...], str, int]] = field(default_factory=list)
    r"""`(path, shape, dtype, bytes)` of every array."""
    left_out: tuple[str, ...] = ()
    r"""the frozen parameters the file leaves out (`save_frozen=False`)."""
    damaged: dict[str, str] = field(default_factory=dict)
    r"""of a damaged file (`read_damaged`), what is wrong with each bad array, by path."""


def _is_orbax(directory: str) -> bool:
    return any(
        _STEP_NAME.fullmatch(name)
        and os.path.isdir(os.path.join(directory, name))
        and os.path.exists(os.path.join(directory, name, "meta"))
        for name in os.listdir(directory)
    )


def list_checkpoints(directory: str) -> list[CheckpointEntry]:
    r"""Every checkpoint in `directory`, oldest first, each verified.

    Files are read whole, every checksum checked; Orbax steps are restored
    whole (Orbax stores no checksums: a missing or truncated array shows, a
    flipped bit inside one does not).

    Raises:
        CheckpointError: if `directory` is not a readable directory.
    """
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory!r} is not a directory: {_what_is(directory)}.")
    if _is_orbax(directory):
        return _orbax_entries(directory)
    entries = []
    for name in sorted(os.listdir(directory)):
        match = _FILE_NAME.fullmatch(name)
        if name.startswith(TEMPORARY_PREFIX) or match is None:
            continue
        path = os.path.join(directory, name)
        try:
            status = os.stat(path)
        except OSError:
            if not os.path.lexists(path):
                continue  # removed since the listing (a writer pruning it)
            status = os.lstat(path)  # a symbolic link to nothing, or one that loops
        size = _directory_size(path) if os.path.isdir(path) else status.st_size
        kind = match.group("kind")
        metric = ""
        if kind != "regular":
            group, metric_name = (urllib.parse.unquote(match.group(n)) for n in ("group", "metric"))
            metric = f"{group}/{metric_name}"
        entry = CheckpointEntry(path, kind, int(match.group("step")), size, status.st_mtime)
        entry.metric = metric
        _verify_file(entry)
        if not entry.intact and not os.path.lexists(path):
            continue  # removed while it was read
        entries.append(entry)
    entries.sort(key=lambda entry: (entry.kind, entry.metric, entry.step))
    for kind, metric in {(entry.kind, entry.metric) for entry in entries}:
        intact = [e for e in entries if (e.kind, e.metric) == (kind, metric) and e.intact]
        if intact:
            max(intact, key=lambda entry: entry.step).resume = True
    return entries


def _what_is(path: str) -> str:
    r"""What stands at `path`, for a message that says why it is no directory.

    >>> _what_is("/no/such/place")
    'nothing is there'
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a symbolic link to nothing" if os.path.islink(path) else "nothing is there"
    except OSError as error:
        return "a symbolic link that loops" if error.errno == errno.ELOOP else str(error)
    if stat.S_ISREG(mode):
        return "a file"
    return f"not a file nor a directory (mode {stat.filemode(mode)})"


def _verify_file(entry: CheckpointEntry) -> None:
    try:
        _, meta = parse.read(entry.path)
        if meta["step"] != entry.step:
            raise CheckpointError(
                f"its name says step {entry.step}, its contents step {meta['step']}"
            )
    except (FlaxLoopError, ValueError) as error:
        entry.status, entry.problem = "damaged", str(error)
    except OSError as error:  # the system's refusal, not the contents
        entry.status, entry.problem = "unreadable", str(error)


def _directory_size(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def _orbax_entries(directory: str) -> list[CheckpointEntry]:
    from flax_loop.checkpoint._orbax_store import read_orbax_step

    entries = []
    for name in sorted((n for n in os.listdir(directory) if _STEP_NAME.fullmatch(n)), key=int):
        path = os.path.join(directory, name)
        try:
            if not os.path.isdir(path):
                continue
            entry = CheckpointEntry(
                path, "orbax", int(name), _directory_size(path), os.stat(path).st_mtime
            )
        except FileNotFoundError:
            continue  # removed since the listing (a writer pruning it)
        missing = _missing_items(path)
        if missing:
            entry.status = "incomplete"
            entry.problem = (
                f"it holds no {' or '.join(missing)}: an interrupted write or pruning "
                "left it (a resume skips it; remove it)"
            )
        else:
            try:
                read_orbax_step(directory, int(name), read_arrays=True)
            except PermissionError as error:
                entry.status, entry.problem = "unreadable", str(error)
            except Exception as error:
                entry.status, entry.problem = "damaged", f"{type(error).__name__}: {error}"
        entries.append(entry)
    intact = [entry for entry in entries if entry.intact]
    if intact:
        intact[-1].resume = True
    return entries


def _missing_items(step_folder: str) -> list[str]:
    return [
        item for item in ("state", "meta") if not os.path.isdir(os.path.join(step_folder, item))
    ]


def read_contents(path: str) -> CheckpointContents:
    r"""What the checkpoint file or Orbax step folder at `path` holds.

    Raises:
        CheckpointError: if it cannot be read (damaged, unreadable, neither).
    """
    if os.path.isdir(path):
        from flax_loop.checkpoint._orbax_store import read_orbax_step

        directory, name = os.path.split(os.path.abspath(path))
        if not _STEP_NAME.fullmatch(name):
            raise CheckpointError(
                f"{path!r} is a directory, not a checkpoint file or an Orbax step "
                "folder; list a directory with `flax-loop ls`."
            )
        missing = _missing_items(path)
        if missing:
            raise CheckpointCorruptError(
                f"{path!r} is an incomplete Orbax step: it holds no {' or '.join(missing)}."
            )
        try:
            meta, shapes = read_orbax_step(directory, int(name))
        except FlaxLoopError:
            raise
        except Exception as error:
            raise CheckpointCorruptError(
                f"{path!r} cannot be read as an Orbax step: {type(error).__name__}: {error}."
            ) from None
        arrays = [
            (key, shape, dtype, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
            for key, (shape, dtype) in shapes.items()
        ]
        return CheckpointContents(
            path,
            int(meta["step"]),
            int(meta.get("version", 0) or 0),
            meta.get("metrics") or {},
            "rnkey" in meta,
            meta.get("data_state"),
            arrays,
        )
    tree, meta = parse.read(path)
    arrays = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}/{key}" if prefix else str(key))
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                walk(value, f"{prefix}/{index}")
        elif node is not None:
            array = np.asarray(node)
            arrays.append((prefix, tuple(array.shape), array.dtype.name, array.nbytes))

    walk(tree, "")
    return CheckpointContents(
        path,
        int(meta["step"]),
        int(meta.get("version", 0)),
        meta.get("metrics") or {},
        isinstance(meta.get("rnkey"), dict),
        meta.get("data_state"),
        arrays,
        _left_out(meta),
    )


def read_damaged(path: str) -> CheckpointContents:
    r"""What a damaged checkpoint file still shows: its metadata and every
    array, each bad one with its problem (`damaged`).

    Raises:
        CheckpointError: if not even the footer (the metadata) can be read.
    """
    with parse._open_regular(path) as stream:
        footer, entries, data_end = parse.read_footer(stream, path)
        names = array_names(footer.get("tree"))
        arrays, damaged = [], {}
        for index, entry in enumerate(entries):
            name = names.get(index, str(index))
            try:
                with Checksums() as checksums:
                    array = parse._read_array(stream, path, name, entry, data_end, checksums)
                arrays.append((name, tuple(array.shape), array.dtype.name, array.nbytes))
            except CheckpointCorruptError as error:
                shape: Any = entry.get("shape")
                size: Any = entry.get("nbytes")
                shape = tuple(shape) if isinstance(shape, list) else ()
                size = size if isinstance(size, int) else 0
                arrays.append((name, shape, str(entry.get("dtype")), size))
                damaged[name] = str(error).replace(f"{path} is damaged: ", "")
    step = footer.get("step")
    metrics = footer.get("metrics")
    return CheckpointContents(
        path,
        step if isinstance(step, int) else -1,
        int(footer.get("version", 0) or 0),
        metrics if isinstance(metrics, dict) else {},
        isinstance(footer.get("rnkey"), dict),
        footer.get("data_state"),
        arrays,
        _left_out(footer),
        damaged,
    )


def _left_out(meta: dict[str, Any]) -> tuple[str, ...]:
    left_out = LeftOut.from_meta(meta.get("frozen"))
    return () if left_out is None else left_out.paths
