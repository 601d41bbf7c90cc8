r"""Writing checkpoints to files, keeping the newest `keep` of them."""

import atexit
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from flax_loop import console
from flax_loop.checkpoint import _file
from flax_loop.checkpoint._checkpoint import Checkpoint, Summary, expect
from flax_loop.checkpoint._file import REGULAR_PREFIX, CheckpointFile
from flax_loop.errors import CheckpointError, ConfigError
from flax_loop.parallel import to_host


@dataclass
class CheckpointFileWriter:
    r"""A writer of checkpoint files; returns what it is given, so it chains.

    >>> writer = CheckpointFileWriter(output_dir="ckpts", keep=2)
    >>> for checkpoint in loop:
    ...     writer(checkpoint)

    Writes are atomic (a crash leaves the previous files intact); older files
    beyond `keep` are removed only once the new one is in place. With several
    processes, process 0 writes.

    With `background=True` the caller waits only for the state's copy to host
    memory; serialization, checksums and the file write run on a worker
    thread. A failed write raises at the next write, at `wait()` or at
    `close()`; pending writes finish before the interpreter exits.
    """

    output_dir: str
    r"""a directory path for checkpoint files."""

    keep: int = 1
    r"""the number of newest checkpoint files to keep."""

    overwrite: bool = True
    r"""whether a checkpoint may replace files of the same or a later step
    (left by an earlier run); if not, such a file is an error."""

    background: bool = field(default=False, kw_only=True)
    r"""whether to write files on a worker thread, off the training loop's path."""

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"keep must be an integer >= 1; got {self.keep!r}.")
        if not isinstance(self.output_dir, (str, os.PathLike)):
            raise ConfigError(f"output_dir must be a path; got {type(self.output_dir).__name__}.")
        self.output_dir = os.fspath(self.output_dir)
        self._cleaned = False
        self._lock = threading.Lock()
        self._pending: Future[str] | None = None
        self._executor: ThreadPoolExecutor | None = None

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
                if the previous write failed); the files already in the
                directory are left intact.
        """
        expect(checkpoint, Checkpoint, type(self).__name__)
        if not console.is_main_process():
            return checkpoint
        self.wait()  # one write at a time: never race the previous one
        prefix = prefix or self._prefix()
        if not self._cleaned:
            _file.clean_temporary(self.output_dir, prefix)
            self._cleaned = True
        existing = _file.list_steps(self.output_dir, prefix)
        later = [path for step, path in existing if step >= checkpoint.step]
        if later and not self.overwrite:
            raise CheckpointError(
                f"{later[0]} is at step {checkpoint.step} or later; pass "
                "overwrite=True to replace it, or write to another output_dir."
            )
        file = to_file(checkpoint)
        if not self.background:
            self._save(prefix, file)
            return checkpoint
        host = _to_host_memory(file)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="flax_loop-writer")
            _pending_writers.add(self)
        with self._lock:
            self._pending = self._executor.submit(self._save, prefix, host)
        return checkpoint

    def wait(self) -> None:
        r"""Waits for a background write in progress; raises if it failed."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        r"""Finishes pending writes and stops the worker thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
                _pending_writers.discard(self)

    def __enter__(self) -> "CheckpointFileWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __hash__(self) -> int:
        return id(self)

    def _save(self, prefix: str, file: CheckpointFile) -> str:
        try:
            written = _file.save(self.output_dir, prefix, file)
        except CheckpointError:
            raise
        except OSError as error:
            raise CheckpointError(
                f"Writing the checkpoint of step {file.step} to {self.output_dir!r} "
                f"failed: {error}. The files already there are intact."
            ) from error
        self._prune(prefix, written, int(file.step))
        return written

    def _prune(self, prefix: str, written: str, step: int) -> None:
        newest_first = _file.list_steps(self.output_dir, prefix)
        stale = [path for s, path in newest_first if s > step]
        kept = [path for s, path in newest_first if s <= step]
        for path in stale + kept[self.keep :]:
            if path != written:
                _file.remove_quietly(path)


def to_file(checkpoint: Checkpoint) -> CheckpointFile:
    r"""The part of a checkpoint (or summary) that goes into a file."""
    metrics: Any = checkpoint.metrics if isinstance(checkpoint, Summary) else {}
    return CheckpointFile(
        model_params=checkpoint.model_params,
        model_state=checkpoint.model_state,
        optimizer_state=checkpoint.optimizer_state,
        step=checkpoint.step,
        metrics=metrics,
        rnkey=checkpoint.rnkey,
        data_state=checkpoint.data_state,
    )


def _to_host_memory(file: CheckpointFile) -> CheckpointFile:
    r"""The file's arrays copied to host memory (numpy), ready for a thread."""

    params, model_state, optimizer_state = to_host(
        (file.model_params, file.model_state, file.optimizer_state)
    )
    return CheckpointFile(
        model_params=params,
        model_state=model_state,
        optimizer_state=optimizer_state,
        step=file.step,
        metrics=file.metrics,
        rnkey=file.rnkey,
        data_state=file.data_state,
    )


_pending_writers: "weakref.WeakSet[CheckpointFileWriter]" = weakref.WeakSet()


@atexit.register
def _finish_pending_writes() -> None:
    for writer in list(_pending_writers):
        try:
            writer.close()
        except Exception as error:  # at exit, report rather than lose it
            console.log(f"[red]A background checkpoint write failed:[/red] {error}")
