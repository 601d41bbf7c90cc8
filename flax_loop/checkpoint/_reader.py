r"""Reading the newest intact checkpoint file of a directory."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import serialization

from flax_loop import console
from flax_loop.checkpoint._file import (
    REGULAR_PREFIX,
    CheckpointFile,
    list_steps,
    load,
    restore_key,
)
from flax_loop.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
)

_PARTS = ("model_params", "model_state", "optimizer_state")


@dataclass
class CheckpointFileReader:
    r"""A reader of the newest intact checkpoint file in a directory.

    >>> loop = TrainLoop(init=CheckpointFileReader(dir="ckpts", target=model.init),
    ...                  task=task, rnkey=jax.random.key(0), n_steps=1000)

    A damaged file is skipped, with a message naming it and why, and the
    next newest is read. If files exist but none is intact, the reader
    raises rather than start afresh.
    """

    dir: str
    r"""a directory path for checkpoint files."""

    target: Callable[..., Any]
    r"""the init function of the model the checkpoint belongs to; a loop uses it
    to initialize the model when the directory holds no checkpoint."""

    def __call__(self, initializer: CheckpointFile) -> CheckpointFile:
        r"""Reads the newest intact checkpoint file.

        Args:
            initializer: the state at step 0, giving the expected tree and shapes.

        Returns:
            the file's contents in the initializer's structure, or the
            initializer itself when the directory holds no checkpoint.

        Raises:
            CheckpointCorruptError: if files exist but none is intact.
            CheckpointMismatchError: if the file holds another model.
            CheckpointVersionError: if the file has a newer format.
        """
        return self.read(initializer)  # type: ignore[return-value]

    def _prefix(self) -> str:
        return REGULAR_PREFIX

    def read(
        self, initializer: CheckpointFile | None, prefix: str | None = None
    ) -> CheckpointFile | dict[str, Any] | None:
        r"""Reads the newest intact file with `prefix`.

        Without an initializer, returns the file's raw contents as a dict
        (or `None` when there is no file).
        """
        if initializer is not None and not isinstance(initializer, CheckpointFile):
            raise ConfigError(
                f"Cannot restore a checkpoint from {self.dir!r}: the initializer "
                f"must be a CheckpointFile or None; got {type(initializer).__name__}."
            )
        found = self._read_newest(prefix or self._prefix())
        if found is None:
            return initializer
        path, tree, meta = found
        if initializer is None:
            return {**tree, **meta, "path": path}
        return _restore(path, tree, meta, initializer)

    def _read_newest(self, prefix: str) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
        candidates = list_steps(self.dir, prefix)
        problems = []
        for _, path in candidates:
            try:
                tree, meta = load(path)
            except CheckpointCorruptError as error:
                problems.append(str(error))
                console.log(f"[yellow]Skipped a damaged checkpoint:[/yellow] {error}")
                continue
            except OSError as error:
                if isinstance(error, CheckpointError):
                    raise
                problems.append(f"{path}: {error}")
                continue
            return path, tree, meta
        if candidates:
            reasons = "; ".join(problem.rstrip(".") for problem in problems)
            raise CheckpointCorruptError(
                f"Every checkpoint file in {self.dir!r} is damaged, so none was "
                f"loaded and none was removed ({reasons}). Move them "
                "away to start afresh."
            )
        return None


def _flatten(tree: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    if isinstance(tree, dict):
        flat: dict[str, tuple[int, ...]] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}/{key}"))
        return flat
    return {prefix or "/": tuple(np.shape(tree))}


def _restore(
    path: str, tree: dict[str, Any], meta: dict[str, Any], initializer: CheckpointFile
) -> CheckpointFile:
    expected = {part: serialization.to_state_dict(getattr(initializer, part)) for part in _PARTS}
    want = _flatten(expected)
    have = _flatten({part: tree.get(part, {}) for part in _PARTS})
    if want != have:
        lines = []
        for name in sorted(set(want) | set(have)):
            if want.get(name) != have.get(name):
                lines.append(
                    f"{name}: model {want.get(name, 'absent')}, file {have.get(name, 'absent')}"
                )
        shown = "; ".join(lines[:12]) + (f"; and {len(lines) - 12} more" if len(lines) > 12 else "")
        raise CheckpointMismatchError(
            f"{path} holds another model: {len(lines)} paths differ ({shown}). "
            "Point the reader at this model's checkpoint directory."
        )

    def restored(part: str) -> Any:
        target = getattr(initializer, part)
        cast = jax.tree.map(
            lambda t, v: np.asarray(v, dtype=t.dtype) if hasattr(t, "dtype") else v,
            serialization.to_state_dict(target),
            tree[part],
        )
        return serialization.from_state_dict(target, cast)

    return CheckpointFile(
        model_params=restored("model_params"),
        model_state=restored("model_state"),
        optimizer_state=restored("optimizer_state"),
        step=int(meta.get("step", 0)),
        metrics=meta.get("metrics") or {},
        version=int(meta.get("version", 0)),
        rnkey=restore_key(meta, path),
        data_state=meta.get("data_state"),
    )
