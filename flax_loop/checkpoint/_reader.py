r"""Reading the newest intact checkpoint file of a directory."""

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flax import serialization

from flax_loop.checkpoint._checkpoint import CheckpointFile, Saved, check_held_as_saved
from flax_loop.checkpoint._frozen import flatten, inserted
from flax_loop.checkpoint._names import REGULAR_PREFIX, LeftOut, one_directory
from flax_loop.checkpoint.format import list_steps, restore_key
from flax_loop.checkpoint.parse import read
from flax_loop.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
)
from flax_loop.log import log

STATE_PARTS = Saved.CORE
r"""The parts of a checkpoint file that every file holds."""


@dataclass
class CheckpointFileReader:
    r"""A reader of the newest intact checkpoint file in a directory.

    >>> import jax
    >>> import flax.linen as nn
    >>> from flax_loop import TrainLoop
    >>> import pathlib, tempfile
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> import optax
    >>> import numpy as np
    >>> from flax_loop import TrainTask
    >>> model = nn.Dense(3)
    >>> def cross_entropy(logits, labels):
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    >>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
    >>> loop = TrainLoop(init=CheckpointFileReader(dir=str(tmp / "ckpts"), target=model.init),
    ...                  task=task, rnkey=jax.random.key(0), n_steps=4, stdout=False)
    >>> loop.step     # an empty directory: training starts at step 0
    0

    A damaged file (checksum, format) is skipped, with a message naming it
    and why, and the next newest is read; if files exist but none is intact,
    the reader raises rather than start afresh. A file that cannot be read
    at all (permissions, an I/O error) is an error, not damage: the reader
    never silently resumes from an older file.
    """

    dir: str = None  # type: ignore[assignment]
    r"""a directory path for checkpoint files."""

    target: Any = None
    r"""the init function of the model the checkpoint belongs to; a loop uses it
    to initialize the model when the directory holds no checkpoint."""

    output_dir: str | None = field(default=None, kw_only=True, repr=False)
    r"""`dir` as the writers spell it (either one is taken)."""

    def __post_init__(self) -> None:
        self.dir = one_directory(
            type(self).__name__, self.dir, self.output_dir, "dir", "output_dir"
        )
        self.output_dir = self.dir

    def __call__(self, initializer: CheckpointFile) -> CheckpointFile:
        r"""The newest file restored into `initializer`'s structure, or
        `initializer` itself when the directory holds no checkpoint."""
        restored = self.restore(initializer)
        return initializer if restored is None else restored

    def _prefix(self) -> str:
        return REGULAR_PREFIX

    def read_newest(self) -> CheckpointFile | None:
        r"""The newest intact file as stored (nested dicts of numpy arrays).

        Returns:
            the file, or `None` when the directory holds no checkpoint.

        Raises:
            CheckpointCorruptError: if files exist but none is intact.
            CheckpointError: if the newest file cannot be read.
            CheckpointVersionError: if the file has a newer format.
        """
        problems = []
        for step, path in list_steps(self.dir, self._prefix()):
            try:
                tree, meta = read(path)
                if meta["step"] != step:
                    raise CheckpointCorruptError(
                        f"{path} is damaged or renamed: its name says step {step}, "
                        f"its contents step {meta['step']}."
                    )
            except CheckpointCorruptError as error:
                problems.append(str(error).rstrip("."))
                log(str(error), lead="Skipped a damaged checkpoint:", style="yellow")
                continue
            except CheckpointError:
                raise
            except OSError as error:
                raise CheckpointError(
                    f"{path} cannot be read: {error}. It was not skipped, so that "
                    "training does not silently resume from an older file: fix the "
                    "file's permissions or disk, or move it away."
                ) from None
            return CheckpointFile(
                **{name: tree.get(name) for name in Saved.CORE},
                carried={name: arrays for name, arrays in tree.items() if name not in Saved.CORE},
                step=int(meta["step"]),
                metrics=meta.get("metrics") or {},
                version=int(meta.get("version", 0)),
                rnkey=restore_key(meta, path),
                data_state=meta.get("data_state"),
                caller_state=meta.get("caller_state"),
                path=path,
                left_out=LeftOut.from_meta(meta.get("frozen")),
                optimizer_names=_names(meta.get("optimizers")),
            )
        if problems:
            raise CheckpointCorruptError(
                f"Every checkpoint file in {self.dir!r} is damaged, so none was "
                f"loaded and none was removed ({'; '.join(problems)}). Move them "
                "away to start afresh."
            )
        return None

    def restore(self, template: CheckpointFile) -> CheckpointFile | None:
        r"""The newest file restored into `template`'s structure and dtypes.

        Args:
            template: the state at step 0 (arrays, or `jax.ShapeDtypeStruct` objects),
                giving the expected tree, shapes and dtypes.

        Returns:
            the file's state in the template's structure (numpy leaves), or
            `None` when the directory holds no checkpoint.

        Raises:
            CheckpointMismatchError: if the file holds another model or
                optimizer (paths, shapes or dtypes differ).
            CheckpointCorruptError, CheckpointError, CheckpointVersionError:
                as `read_newest`.
        """
        if not isinstance(template, CheckpointFile):
            raise ConfigError(
                f"Cannot restore a checkpoint from {self.dir!r}: the template must "
                f"be a CheckpointFile; got {type(template).__name__}."
            )
        file = self.read_newest()
        return None if file is None else restore_into(file, template)


def _alike(model: Any, stored: Any) -> bool:
    r"""Whether two leaves have the same shape and dtype, which `_describe`
    would say alike (a quick check before describing them)."""
    shape, dtype = getattr(model, "shape", None), getattr(model, "dtype", None)
    if shape is None or dtype is None or not isinstance(stored, np.ndarray):
        return False
    return tuple(shape) == stored.shape and dtype == stored.dtype


def _describe(leaf: Any) -> str:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"
    if leaf is _ABSENT:
        return "absent"
    if isinstance(leaf, _LeftOutElsewhere):
        return "a frozen parameter left out"
    return "empty" if leaf == {} else type(leaf).__name__


_ABSENT = object()


class _LeftOutElsewhere:
    r"""A frozen parameter the file left out that this model does not have."""

    def __repr__(self) -> str:
        return "left out"


def _placeholder(leaf: Any) -> Any:
    r"""Where a file left a frozen parameter out: an array of the model's
    shape and dtype that takes no memory (the run puts the value in)."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)
    return _LeftOutElsewhere()


def restore_into(file: CheckpointFile, template: CheckpointFile) -> CheckpointFile:
    r"""A file's state restored into a template's structure.

    Paths, shapes and dtypes must agree exactly: a float32 file is not cast
    into a bfloat16 model, and a file of another optimizer is not forced
    into this one's state.

    Raises:
        CheckpointCorruptError: if the file holds a non-array where an
            array belongs.
        CheckpointMismatchError: naming the file and the paths that differ.
    """
    path = file.path or "the checkpoint"
    # A carried field (a moving average) is restored when the loop carries it
    # and the file has it; a loop that starts carrying one starts it afresh
    # (the step's `init`), and one the loop no longer carries is dropped.
    wanted, held = template.arrays(), file.arrays()
    check_held_as_saved(set(file.carried), set(template.carried), path)
    parts = STATE_PARTS + tuple(
        name for name in template.carried if wanted[name] is not None and name in held
    )
    want = flatten({part: serialization.to_state_dict(wanted[part]) for part in parts})
    # Frozen parameters the file left out take the template's place (their
    # values come from the run's initialization, checked against the digest).
    stored = {part: held.get(part) for part in parts}
    if file.left_out is not None:
        for part in file.left_out.fields:
            if part in parts:
                model = flatten(serialization.to_state_dict(wanted[part]))
                stored[part] = inserted(
                    stored[part] or {},
                    {p: _placeholder(model.get(p)) for p in file.left_out.paths},
                )
    file = file.with_arrays(stored)
    have = flatten(stored)
    _refuse_empty(have, want, path)
    for name, leaf in have.items():
        if name in want and hasattr(want[name], "shape") and not isinstance(leaf, np.ndarray):
            raise CheckpointCorruptError(
                f"{path} is damaged: it holds a {type(leaf).__name__} ({leaf!r:.40}) at "
                f"{name}, where an array belongs."
            )
    differences = []
    for name in sorted(set(want) | set(have)):
        model, kept = want.get(name, _ABSENT), have.get(name, _ABSENT)
        if not _alike(model, kept):
            described = _describe(model), _describe(kept)
            if described[0] != described[1]:
                differences.append(f"{name}: model {described[0]}, file {described[1]}")
    if differences:
        shown = "; ".join(differences[:12])
        more = f"; and {len(differences) - 12} more" if len(differences) > 12 else ""
        raise CheckpointMismatchError(
            f"{path} holds another model or optimizer: {len(differences)} paths differ "
            f"({shown}{more}). Point the reader at this model's checkpoint directory, "
            "or train with the model, optimizer and dtypes that wrote it."
        )

    def restored(part: str) -> Any:
        try:
            return serialization.from_state_dict(wanted[part], stored[part] or {})
        except (ValueError, TypeError, KeyError) as error:
            raise CheckpointMismatchError(
                f"{path} does not fit this model's {part}: {error}."
            ) from None

    return file.with_arrays({name: restored(name) for name in parts})


def _refuse_empty(have: dict[str, Any], want: dict[str, Any], path: str) -> None:
    r"""A `CheckpointMismatchError` for an intact file of another trainable
    filter: its optimizer state holds nothing where this run keeps values."""
    empty = sorted(
        name
        for name, leaf in have.items()
        if leaf is None
        and name.startswith("/optimizer_state/")
        and hasattr(want.get(name), "shape")
    )
    if empty:
        shown = ", ".join(empty[:6]) + (f" and {len(empty) - 6} more" if len(empty) > 6 else "")
        raise CheckpointMismatchError(
            f"{path} holds no value at {shown}, where this run keeps one: it was written "
            "with another trainable filter (TrainTask(trainable=...)) or optimizer, whose "
            "state leaves out what it does not train. Resume with the trainable filter "
            "and optimizer that wrote it, or start a new directory."
        )


def _names(stored: Any) -> tuple[str, ...] | None:
    r"""The optimizers' order a file records (`None`: one optimizer, or a
    file written before it was recorded)."""
    if not isinstance(stored, list) or not all(isinstance(name, str) for name in stored):
        return None
    return tuple(stored)
