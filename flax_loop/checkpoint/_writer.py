r"""Writing checkpoints to files, keeping the newest `keep` of them."""

import atexit
import copy
import dataclasses
import os
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from flax_loop.checkpoint import format
from flax_loop.checkpoint._arriving import settle
from flax_loop.checkpoint._checkpoint import Checkpoint, CheckpointFile, Summary, expect
from flax_loop.checkpoint._frozen import leave_out
from flax_loop.checkpoint._names import REGULAR_PREFIX, one_directory
from flax_loop.checkpoint.lock import DirectoryLock
from flax_loop.errors import CheckpointError, ConfigError, check_count
from flax_loop.log import is_main_process, log
from flax_loop.parallel import gather_split, to_host

EXIT_CODE_WRITE_FAILED = 75
r"""The exit status of a process whose last background write failed at exit."""


@dataclass
class CheckpointFileWriter:
    r"""A writer of checkpoint files; returns what it is given, so it chains.

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
    >>> writer = CheckpointFileWriter(output_dir=str(tmp / "ckpts"), keep=2)
    >>> for checkpoint in loop:
    ...     _ = writer(checkpoint)
    >>> sorted(name for name in os.listdir(tmp / "ckpts") if name.endswith(".ckpt"))
    ['regular.3.ckpt', 'regular.4.ckpt']
    >>> writer.close()

    Writes are atomic (a crash leaves the previous files intact); older files
    beyond `keep` are removed only once the new one is in place. While open,
    a writer holds a lock on its kind of files in the directory, so that two
    runs cannot delete each other's files. With several processes, process
    0 writes; every process calls the writer (a state split over the
    processes' devices is gathered into process 0's memory, so it must fit
    there; `OrbaxCheckpointWriter` writes each process's shards instead).

    With `background=True` the caller waits only for the state's copy to host
    memory; serialization, checksums and the file write run on a worker
    thread. A failed write raises at the next write, at `wait()` or at
    `close()`; pending writes finish before the interpreter exits, and if
    one fails then, the process exits with status 75, never 0.
    """

    output_dir: str = None  # type: ignore[assignment]
    r"""a directory path for checkpoint files."""

    keep: int = 1
    r"""the number of newest checkpoint files to keep."""

    overwrite: bool | None = None
    r"""what to do with files of the same or a later step, left by an earlier
    run: by default (`None`) a file of the same step is replaced and a later
    one is an error (a fresh run never deletes a longer run's files); `True`
    replaces and deletes them; `False` makes any of them an error."""

    background: bool = field(default=False, kw_only=True)
    r"""whether to write files on a worker thread, off the training loop's path."""

    save_frozen: bool = field(default=True, kw_only=True)
    r"""whether files hold the parameters no optimizer trains
    (`TrainTask(trainable=...)`, `Checkpoint.frozen`). `False` leaves them
    out (a LoRA file holds its low-rank weights, not the base): a run resumed
    from such a file takes them from its `init` and checks them against a
    digest the file keeps, raising `CheckpointMismatchError` if they differ."""

    stdout: bool = field(default=True, kw_only=True)
    r"""whether to say when the writer removes files an earlier run left
    (`overwrite=True`)."""

    dir: str | None = field(default=None, kw_only=True, repr=False)
    r"""`output_dir` as the readers spell it (either one is taken)."""

    def __post_init__(self) -> None:
        output_dir = one_directory(
            type(self).__name__, self.output_dir, self.dir, "output_dir", "dir"
        )
        self.output_dir = check_writer_options(output_dir, self.keep, self.overwrite)
        self.dir = self.output_dir
        self._locks: dict[str, DirectoryLock] = {}
        self._mutex = threading.Lock()
        self._pending: Future[str] | None = None
        self._executor: ThreadPoolExecutor | None = None
        # whether this process writes: known from the first write on (a
        # checkpoint comes after jax.distributed is set up)
        self._writes: bool | None = None

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        r"""Writes a checkpoint (or a summary, with its metrics) and returns it."""
        return self.write(checkpoint)

    def _prefix(self) -> str:
        return REGULAR_PREFIX

    def write(
        self, checkpoint: Checkpoint | Summary, prefix: str | None = None
    ) -> Checkpoint | Summary:
        r"""Writes `checkpoint` under `prefix` and prunes older files.

        Raises:
            ConfigError: if `checkpoint` is not a `Checkpoint` or `Summary`.
            CheckpointError: if the file cannot be written (in the background:
                if the previous write failed), if a later step's file is in
                the way, or if another writer holds the directory; the files
                already in the directory are left intact.
        """
        expect(checkpoint, Checkpoint, type(self).__name__)
        settle(checkpoint)  # an interval that went non-finite: never written
        file = to_file(checkpoint, self.save_frozen)
        # State split over several processes comes to process 0's host: every
        # process takes part in gathering it.
        file = file.map_arrays(gather_split)
        if self._writes is None:
            self._writes = is_main_process()
        if not self._writes:
            return checkpoint
        self.wait()  # one write at a time: never race the previous one
        prefix = prefix or self._prefix()
        self._check_later_files(prefix, int(checkpoint.step))  # before locking: a refusal
        self._lock(prefix)  # leaves the directory free
        self._check_later_files(prefix, int(checkpoint.step))  # now that no one else writes
        if not self.background:
            self._save(prefix, file)
            return checkpoint
        host = _to_host_memory(file)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="flax_loop-writer")
            _open_writers.add(self)
        with self._mutex:
            self._pending = self._executor.submit(self._save, prefix, host)
            self._pending.add_done_callback(_note_failure)
        return checkpoint

    def _lock(self, prefix: str) -> None:
        if prefix not in self._locks:
            format.ensure_directory(self.output_dir)
            lock = DirectoryLock(self.output_dir, prefix)
            lock.acquire()
            self._locks[prefix] = lock
            format.clean_temporary(self.output_dir, prefix)

    def _check_later_files(self, prefix: str, step: int) -> None:
        existing = format.list_steps(self.output_dir, prefix)
        in_the_way = [
            (s, path) for s, path in existing if s > step or (s == step and self.overwrite is False)
        ]
        if in_the_way and self.overwrite is True and is_main_process():
            log(
                f"removing {len(in_the_way)} file(s) of steps {sorted(s for s, _ in in_the_way)} "
                f"an earlier run left in {self.output_dir} (overwrite=True).",
                self.stdout,
                lead=f"{type(self).__name__}:",
            )
        if in_the_way and self.overwrite is not True:
            later_step, later = in_the_way[0]
            raise CheckpointError(
                f"Cannot write step {step} to {self.output_dir!r}: it holds {later} of "
                f"step {later_step}, which this writer would replace or delete. Resume "
                "from it (init=CheckpointFileReader(dir=...)), write to another "
                "output_dir, or pass overwrite=True to replace it."
            )

    def wait(self) -> None:
        r"""Waits for a background write in progress; raises if it failed."""
        with self._mutex:
            pending, self._pending = self._pending, None
        if pending is not None:
            _seen(pending)
            pending.result()

    def close(self) -> None:
        r"""Finishes pending writes, stops the worker thread and releases the directory."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            _open_writers.discard(self)
            for lock in self._locks.values():
                lock.release()
            self._locks = {}

    def __enter__(self) -> "CheckpointFileWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __hash__(self) -> int:
        return id(self)

    def _save(self, prefix: str, file: CheckpointFile) -> str:
        try:
            written = format.save(self.output_dir, prefix, file)
        except CheckpointError:
            raise
        except OSError as error:
            raise CheckpointError(
                f"Writing the checkpoint of step {file.step} to {self.output_dir!r} "
                f"failed: {error}. The files already there are intact."
            ) from None
        self._prune(prefix, written, int(file.step))
        return written

    def _prune(self, prefix: str, written: str, step: int) -> None:
        newest_first = format.list_steps(self.output_dir, prefix)
        later = [path for s, path in newest_first if s > step]  # only with overwrite=True
        kept = [path for s, path in newest_first if s <= step]
        for path in later + kept[self.keep :]:
            if path != written:
                format.remove_quietly(path)


def check_writer_options(output_dir: Any, keep: Any, overwrite: Any) -> str:
    r"""A writer's directory as a string, or a `ConfigError` for a bad option."""
    check_count("keep", keep, 1)
    if not isinstance(output_dir, (str, os.PathLike)):
        raise ConfigError(f"output_dir must be a path; got {type(output_dir).__name__}.")
    if overwrite not in (None, True, False):
        raise ConfigError(f"overwrite must be None, True or False; got {overwrite!r}.")
    return os.fspath(output_dir)


def to_file(checkpoint: Checkpoint, save_frozen: bool = True) -> CheckpointFile:
    r"""The part of a checkpoint (or summary) that goes into a file; without
    its frozen parameters unless `save_frozen` (a collective with several
    processes: every process calls it)."""
    metrics: Any = checkpoint.metrics if isinstance(checkpoint, Summary) else {}
    file = CheckpointFile.from_saved(checkpoint, metrics=metrics)
    if save_frozen or checkpoint.frozen is None:
        return file
    arrays = file.arrays()
    fields = ("model_params",) + tuple(
        name for name in checkpoint.mirrors_params if arrays.get(name) is not None
    )
    cut = {name: leave_out(arrays[name], checkpoint.frozen) for name in fields}
    left_out = dataclasses.replace(cut["model_params"][1], fields=fields)
    return dataclasses.replace(
        file.with_arrays({name: kept for name, (kept, _) in cut.items()}), left_out=left_out
    )


def _to_host_memory(file: CheckpointFile) -> CheckpointFile:
    r"""A copy of the file that nothing else changes: arrays in host memory
    (one transfer), metadata deep-copied, ready for a worker thread."""
    return dataclasses.replace(
        file.map_arrays(to_host),
        metrics=copy.deepcopy(file.metrics),
        data_state=copy.deepcopy(file.data_state),
        caller_state=copy.deepcopy(file.caller_state),
    )


_open_writers: "weakref.WeakSet[CheckpointFileWriter]" = weakref.WeakSet()

# Background writes that failed where no caller has seen the error yet (its
# writer may be gone: a writer made for one call and dropped); reported at exit.
_unseen_failures: dict[Future, BaseException] = {}
_seen_writes: "weakref.WeakSet[Future]" = weakref.WeakSet()
_failures_lock = threading.Lock()


def _note_failure(future: Future) -> None:
    error = future.exception()
    with _failures_lock:
        if error is not None and future not in _seen_writes:
            _unseen_failures[future] = error


def _seen(future: Future) -> None:
    r"""A caller takes the write's result (and its error) now."""
    with _failures_lock:
        _seen_writes.add(future)
        _unseen_failures.pop(future, None)


@atexit.register
def _finish_pending_writes() -> None:
    failed = False
    for writer in list(_open_writers):
        try:
            writer.close()
        except Exception as error:  # at exit, report rather than lose it
            failed = True
            log(str(error), lead="A background checkpoint write failed at exit:", style="red")
    with _failures_lock:
        unseen = list(_unseen_failures.values())
        _unseen_failures.clear()
    for lost in unseen:  # of writers no longer there to close
        failed = True
        log(str(lost), lead="A background checkpoint write failed:", style="red")
    if failed:
        # A scheduler must not record success when the last file is missing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_CODE_WRITE_FAILED)
