r"""`SummaryWriter`: summaries as TensorBoard scalars, through tensorboardX.

Install the extra: `pip install "flax_loop[tensorboard]"` (no TensorFlow).
"""

import itertools
import os
import time
import weakref
from typing import Any

from flax_loop.checkpoint import Checkpoint, as_summary, expect
from flax_loop.errors import ConfigError
from flax_loop.log import is_main_process, log


class SummaryWriter:
    r"""Writes each summary's metrics as scalars `group/metric` at its step.

    >>> import jax
    >>> import optax
    >>> import numpy as np
    >>> import flax.linen as nn
    >>> from flax_loop import TrainLoop, TrainTask, EvalLoop, EvalTask
    >>> import pathlib, tempfile
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> model = nn.Dense(3)
    >>> def cross_entropy(logits, labels):
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    >>> test_batches = batches[:2]
    >>> def accuracy(logits, labels):
    ...     return (logits.argmax(-1) == labels).mean()
    >>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
    >>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0), n_steps=4,
    ...                  n_steps_per_checkpoint=3, stdout=False)
    >>> eval_loop = EvalLoop(EvalTask(model.apply, {"accuracy": accuracy}, test_batches),
    ...                      rnkey=jax.random.key(1), n_steps=None)
    >>> writer = SummaryWriter(output_dir=str(tmp / "runs"))
    >>> for checkpoint in loop:
    ...     _ = writer(eval_loop(checkpoint))   # or writer(checkpoint): its train statistics
    TensorBoard: tensorboard --logdir ... shows the events.
    >>> writer.close()
    >>> [name.split(".")[0] for name in os.listdir(tmp / "runs")]
    ['events']

    One event file per writer is kept open, flushed after every summary and
    closed at `close()`, on `with`-exit, when the writer is dropped, or at
    interpreter exit. Its name is the writer's own (process id and a
    counter), so several writers of one directory never share a file. Only
    process 0 writes.
    """

    def __init__(self, output_dir: str, stdout: bool = True) -> None:
        if not isinstance(output_dir, (str, os.PathLike)):
            raise ConfigError(f"output_dir must be a path; got {type(output_dir).__name__}.")
        self.output_dir = os.fspath(output_dir)
        self.stdout = stdout
        r"""whether the first write says how to see the events (`tensorboard --logdir`)."""
        self._writer: Any | None = None
        self._closing: weakref.finalize | None = None

    def _open(self) -> Any:
        if self._writer is None:
            try:
                from tensorboardX.event_file_writer import EventsWriter
            except ImportError as error:
                raise ConfigError(
                    'SummaryWriter needs tensorboardX: pip install "flax_loop[tensorboard]".'
                ) from error
            os.makedirs(self.output_dir, exist_ok=True)
            # The synchronous writer: tensorboardX's SummaryWriter queues events
            # for a thread, and its flush() does not wait for that queue. Its
            # file name holds the second it was made: the suffix keeps two
            # writers made in one second apart.
            suffix = f".{os.getpid()}.{next(_writer_numbers)}"
            self._writer = EventsWriter(os.path.join(self.output_dir, "events"), suffix)
            log(
                f"tensorboard --logdir {self.output_dir} shows the events.",
                self.stdout,
                lead="TensorBoard:",
            )
            # closed when this writer is dropped or at exit, whichever comes first
            self._closing = weakref.finalize(self, self._writer.close)
        return self._writer

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        r"""Writes the summary's (or checkpoint's) scalars and returns it unchanged."""
        expect(checkpoint, Checkpoint, "SummaryWriter")
        if not is_main_process():
            return checkpoint
        summary = as_summary(checkpoint)
        writer = self._open()
        from tensorboardX.proto import event_pb2, summary_pb2

        values = [
            summary_pb2.Summary.Value(tag=f"{group}/{name}", simple_value=float(value))
            for group, metrics in summary.metrics.items()
            for name, value in metrics.items()
        ]
        now = time.time()
        losses = summary.losses if summary.losses is not None else ()
        first = int(summary.step) - len(losses) + 1
        for offset, step_loss in enumerate(losses):  # the interval's curve, step by step
            value = summary_pb2.Summary.Value(tag="train/step_loss", simple_value=float(step_loss))
            writer.write_event(
                event_pb2.Event(
                    wall_time=now, step=first + offset, summary=summary_pb2.Summary(value=[value])
                )
            )
        writer.write_event(
            event_pb2.Event(
                wall_time=now, step=int(summary.step), summary=summary_pb2.Summary(value=values)
            )
        )
        writer.flush()
        return checkpoint

    def close(self) -> None:
        r"""Flushes and closes the event file."""
        if self._closing is not None:
            self._closing()  # closes the file, once
            self._closing = None
        self._writer = None

    def __enter__(self) -> "SummaryWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_writer_numbers = itertools.count()
