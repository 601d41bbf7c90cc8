r"""Checkpoints through Orbax: every process writes its own shards, asynchronously.

A state split over several hosts cannot be gathered into one file; Orbax
(tensorstore) writes each process's shards of each array in parallel, and
restores them into any layout, on any number of devices. The directory is an
Orbax `CheckpointManager`'s: a folder per step holding the arrays
(`state`) and flax_loop's metadata (`meta`: step, metrics, run key, data
state). Needs `pip install flax_loop[orbax]`.

>>> import jax
>>> import optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop import TrainLoop, TrainTask
>>> import pathlib, tempfile
>>> tmp = pathlib.Path(tempfile.mkdtemp())
>>> model = nn.Dense(3)
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
>>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
>>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0), n_steps=4,
...                  n_steps_per_checkpoint=3, stdout=False)
>>> writer = OrbaxCheckpointWriter(output_dir=str(tmp / "orbax"), keep=2)
>>> for checkpoint in loop:
...     _ = writer(checkpoint)
>>> writer.close()
>>> OrbaxCheckpointReader(dir=str(tmp / "orbax"), target=model.init).steps()
[3, 4]
"""

import math
import operator
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from flax_loop.checkpoint._arriving import settle
from flax_loop.checkpoint._best import KeepsBest, check_best_arguments
from flax_loop.checkpoint._checkpoint import Checkpoint, Summary, expect
from flax_loop.checkpoint._names import one_directory
from flax_loop.checkpoint._orbax_reader import OrbaxCheckpointReader
from flax_loop.checkpoint._orbax_store import (
    META_ITEM,
    STATE_ITEM,
    encode_meta,
    open_manager,
    orbax_call,
    orbax_module,
    read_orbax_step,
)
from flax_loop.checkpoint._writer import EXIT_CODE_WRITE_FAILED, check_writer_options, to_file
from flax_loop.checkpoint.format import WRITTEN
from flax_loop.checkpoint.lock import DirectoryLock
from flax_loop.distributed import others_are_stopping
from flax_loop.distributed.launch import main_process_if_known
from flax_loop.errors import CheckpointError, ConfigError
from flax_loop.log import is_main_process, log

ORBAX_LOCK = "orbax."
r"""The prefix of an Orbax directory's lock file (`.lock.orbax.lock`)."""

_open_writers: "weakref.WeakSet[OrbaxCheckpointWriter]" = weakref.WeakSet()


@dataclass
class OrbaxCheckpointWriter:
    r"""Writes checkpoints through Orbax, keeping the newest `keep` steps.

    Every process must call it: each writes its own shards of the arrays, in
    the background (the call returns once the arrays are copied off the
    devices). Pending writes finish at the next write, at `wait()`, at
    `close()` and at interpreter exit; if one fails at exit, the process
    exits with status 75, never 0. A crash mid-write leaves the earlier
    steps intact (Orbax renames a finished step into place). While open, the
    writer holds the directory's lock (process 0 takes it), so that two runs
    cannot write one directory: made while another run's writer holds it,
    it waits a few seconds, then raises `CheckpointError` naming the holder,
    before any training. (Made by a process of several before
    `jax.distributed.initialize`, it takes the lock at its first write.) A
    writer made again for the same directory in the same process (a notebook
    cell run again) closes the earlier one, finishing its writes, and takes
    its place: a write through the earlier one then raises `CheckpointError`.
    """

    output_dir: str = None  # type: ignore[assignment]
    r"""a directory path for the checkpoints (one folder per step)."""

    keep: int = 1
    r"""the number of newest checkpoints to keep."""

    overwrite: bool | None = None
    r"""what to do with steps of the same or a later number left by an earlier
    run: by default (`None`) the same step is replaced and a later one is an
    error; `True` deletes them; `False` makes any of them an error."""

    background: bool = field(default=True, kw_only=True)
    r"""whether writes run in the background (Orbax's asynchronous save)."""

    save_frozen: bool = field(default=True, kw_only=True)
    r"""whether checkpoints hold the parameters no optimizer trains; Orbax
    checkpoints hold every parameter (`True`); `CheckpointFileWriter(
    save_frozen=False)` writes files without them."""

    stdout: bool = field(default=True, kw_only=True)
    r"""whether to say when the writer removes steps an earlier run left
    (`overwrite=True`)."""

    dir: str | None = field(default=None, kw_only=True, repr=False)
    r"""`output_dir` as the readers spell it (either one is taken)."""

    def __post_init__(self) -> None:
        output_dir = one_directory(
            type(self).__name__, self.output_dir, self.dir, "output_dir", "dir"
        )
        self.output_dir = check_writer_options(output_dir, self.keep, self.overwrite)
        self.dir = self.output_dir
        if self.save_frozen is not True:
            raise ConfigError(
                f"{type(self).__name__}(save_frozen={self.save_frozen!r}): Orbax checkpoints "
                "hold every parameter, the frozen ones too. Write files without them with "
                "CheckpointFileWriter(save_frozen=False) (or LowestCheckpointFileWriter/"
                "HighestCheckpointFileWriter(..., save_frozen=False))."
            )
        self._manager: Any = None
        self._lock: DirectoryLock | None = None
        self._superseded = False
        if main_process_if_known():
            self._take_directory(supersede=True)

    @property
    def manager(self) -> Any:
        r"""the Orbax `CheckpointManager` the writer writes through, opened by
        its first write (`None` before)."""
        return self._manager

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        r"""Writes a checkpoint (or a summary, with its metrics) and returns it."""
        return self.write(checkpoint)

    def write(self, checkpoint: Checkpoint | Summary) -> Checkpoint | Summary:
        r"""Writes `checkpoint` as a step of the directory and prunes older steps.

        Raises:
            ConfigError: if `checkpoint` is not a `Checkpoint` or `Summary`.
            CheckpointError: if a later step is in the way, or Orbax fails.
        """
        expect(checkpoint, Checkpoint, type(self).__name__)
        settle(checkpoint)  # an interval that went non-finite: never written
        ocp = orbax_module()
        manager = self._open()
        step = int(checkpoint.step)
        manager.wait_until_finished()
        self._make_room(manager, step)
        file = to_file(checkpoint)
        # the array fields of the saved state; an absent one (no moving average) is left out
        state = {name: arrays for name, arrays in file.arrays().items() if arrays is not None}
        try:
            manager.save(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE_ITEM: ocp.args.StandardSave(state),
                        META_ITEM: ocp.args.JsonSave(encode_meta(file)),
                    }
                ),
                force=True,
            )
            if not self.background:
                manager.wait_until_finished()
            WRITTEN[:] = [os.path.join(self.output_dir, str(step))]
        except Exception as error:
            raise CheckpointError(
                f"Orbax failed to write step {step} to {self.output_dir!r}: "
                f"{type(error).__name__}: {error}. The steps already there are intact."
            ) from None
        return checkpoint

    def _take_directory(self, supersede: bool = False) -> None:
        r"""Takes the directory's lock (process 0), before Orbax touches it;
        with `supersede`, an earlier writer of this process to the same
        directory is closed and writes no more."""
        if self._lock is not None:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        here = os.path.realpath(self.output_dir)
        for earlier in list(_open_writers) if supersede else []:
            if earlier is not self and os.path.realpath(earlier.output_dir) == here:
                earlier._superseded = True
                earlier.close()  # finishes its pending writes
        lock = DirectoryLock(self.output_dir, ORBAX_LOCK)
        lock.acquire()
        self._lock = lock
        _open_writers.add(self)

    def _open(self) -> Any:
        if self._superseded:
            raise CheckpointError(
                f"This {type(self).__name__} of {self.output_dir!r} was closed when a newer "
                "writer of the same directory was made in this process (a cell run "
                "again?): write through the newer one."
            )
        if self._manager is None:
            if is_main_process():
                self._take_directory()
            try:
                self._manager = orbax_call(
                    "open", self.output_dir, open_manager, self.output_dir, self.keep, False
                )
            except BaseException:
                self._release()
                raise
            _open_writers.add(self)
            _finish_at_exit()
        return self._manager

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def _make_room(self, manager: Any, step: int) -> None:
        manager.reload()
        existing = sorted(manager.all_steps())
        in_the_way = [s for s in existing if s > step or (s == step and self.overwrite is False)]
        if in_the_way and self.overwrite is not True:
            raise CheckpointError(
                f"Cannot write step {step} to {self.output_dir!r}: it holds step "
                f"{in_the_way[-1]}, which this writer would replace or delete. Resume "
                "from it (init=OrbaxCheckpointReader(dir=...)), write to another "
                "output_dir, or pass overwrite=True to replace it."
            )
        removed = [old for old in existing if old >= step]
        if removed and self.overwrite is True and is_main_process():
            log(
                f"removing the steps {removed} an earlier run left in {self.output_dir} "
                "(overwrite=True).",
                self.stdout,
                lead=f"{type(self).__name__}:",
            )
        for old in removed:
            manager.delete(old)

    def wait(self) -> None:
        r"""Waits for a background write in progress.

        Raises:
            CheckpointError: if it failed (a full disk, say).
        """
        if self._manager is not None:
            orbax_call("finish a write to", self.output_dir, self._manager.wait_until_finished)

    def close(self) -> None:
        r"""Finishes pending writes and releases the directory.

        Raises:
            CheckpointError: if a pending write failed; the directory is
                released all the same.
        """
        manager, self._manager = self._manager, None
        _open_writers.discard(self)
        failure: CheckpointError | None = None
        try:
            if manager is not None:
                try:
                    orbax_call("finish a write to", self.output_dir, manager.wait_until_finished)
                except CheckpointError as error:
                    failure = error
                try:
                    orbax_call("close", self.output_dir, manager.close)
                except CheckpointError as error:
                    failure = failure or error  # the first failure says what went wrong
        finally:
            self._release()
        if failure is not None:
            raise failure

    def __enter__(self) -> "OrbaxCheckpointWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __hash__(self) -> int:
        return id(self)


_exit_hook_registered = False


def _finish_at_exit() -> None:
    r"""Registers `_finish_pending_writes` to run as the interpreter begins to
    exit. Orbax finishes a save on thread pools; `atexit` handlers run after
    Python has shut those down (the save then fails, "cannot schedule new
    futures"), so the hook runs among threading's exit calls instead, which
    run first and in reverse order of registration: before the pools'."""
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every CPython since 3.9 has it
        import atexit

        atexit.register(_finish_pending_writes)
    else:
        register(_finish_pending_writes)


def _finish_pending_writes() -> None:
    if others_are_stopping():
        # This process failed and told the others, which stop: a write of
        # several processes cannot finish (waiting, JAX would abort it ~100 s later).
        for writer in [writer for writer in _open_writers if writer.manager is not None]:
            log(
                f"pending writes to {writer.output_dir!r} are left unfinished: this "
                "process failed, so the other processes stop (the steps already there "
                "are intact).",
                lead="Orbax:",
                style="red",
            )
        return
    failed = False
    for writer in list(_open_writers):
        try:
            writer.close()
        except Exception as error:  # at exit, report rather than lose it
            failed = True
            log(str(error), lead="An Orbax checkpoint write failed at exit:", style="red")
    if failed:  # a scheduler must not record success when the last step is missing
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_CODE_WRITE_FAILED)


class _BestOrbaxCheckpointWriter(KeepsBest, OrbaxCheckpointWriter):  # type: ignore[misc]
    def __init__(
        self,
        metric: str,
        group: str = "eval",
        stdout: bool = True,
        output_dir: str | None = None,
        keep: int = 1,
        overwrite: bool | None = None,
        *,
        background: bool = True,
        save_frozen: bool = True,
        dir: str | None = None,
    ) -> None:
        output_dir = one_directory(type(self).__name__, output_dir, dir, "output_dir", "dir")
        check_best_arguments(type(self).__name__, metric, group, output_dir)
        super().__init__(
            output_dir=output_dir,
            keep=keep,
            overwrite=overwrite,
            background=background,
            save_frozen=save_frozen,
            stdout=stdout,
        )
        self.metric, self.group = metric, group
        steps = OrbaxCheckpointReader(dir=self.output_dir, target=None).steps()
        if not steps:
            self._start_from(None, None, stdout)
            return
        meta, _ = read_orbax_step(self.output_dir, steps[-1])
        self._start_from(meta.get("metrics"), os.path.join(self.output_dir, str(steps[-1])), stdout)

    def _write_best(self, summary: Summary) -> None:
        self.write(summary)


class LowestOrbaxCheckpointWriter(_BestOrbaxCheckpointWriter):
    r"""Keeps the Orbax checkpoints of the lowest values of `metrics[group][metric]`
    (the newest step of its directory is the best; read it with `OrbaxCheckpointReader`)."""

    _kind = "lowest"
    _initial = math.inf
    _better = staticmethod(operator.lt)


class HighestOrbaxCheckpointWriter(_BestOrbaxCheckpointWriter):
    r"""Keeps the Orbax checkpoints of the highest values of `metrics[group][metric]`
    (the newest step of its directory is the best; read it with `OrbaxCheckpointReader`)."""

    _kind = "highest"
    _initial = -math.inf
    _better = staticmethod(operator.gt)
