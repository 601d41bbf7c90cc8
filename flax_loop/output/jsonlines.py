r"""`JsonLinesWriter`: summaries as JSON lines, one object per checkpoint.

>>> import jax
>>> import optax
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
>>> checkpoint = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
...                       n_steps=2, stdout=False).next_checkpoint()
>>> eval_loop = EvalLoop(EvalTask(model.apply, {"accuracy": accuracy}, test_batches),
...                      rnkey=jax.random.key(1), n_steps=None)
>>> writer = JsonLinesWriter(str(tmp / "metrics.jsonl"))
>>> _ = writer(eval_loop(checkpoint))
>>> writer.close()
>>> import json
>>> record = json.loads(open(tmp / "metrics.jsonl").readline())
>>> record["step"], sorted(record)[:3]
(1, ['elapsed_time', 'eval/accuracy', 'n_completed_steps'])

`pandas.read_json(path, lines=True)` gives one row per checkpoint and a
column per `group/metric`.
"""

import json
import math
import os
import time
from typing import Any

import numpy as np

from flax_loop.checkpoint import Checkpoint, as_summary, expect
from flax_loop.errors import CheckpointError, ConfigError, MetricError
from flax_loop.log import is_main_process, log


class JsonLinesWriter:
    r"""Appends each summary (or checkpoint) to a JSON-lines file, flushed at once.

    Each line holds `step`, `time` (seconds since the epoch), `elapsed_time`,
    `n_completed_steps`, `preempted`, and every metric as `"group/name"`:
    a number, a vector as a list, a string as it is (`None` and non-finite
    values as `null`). A file from an earlier run is appended to. A line is
    written whole or not at all: a failed write (a full disk) leaves the
    file as it was and raises a `CheckpointError`. Only process 0 writes.

    Args:
        path: the file to append to (its directory is created).
        stdout: whether the first write says when it appends to an earlier
            run's lines (how many, and the last step they hold).
    """

    def __init__(self, path: str, stdout: bool = True) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"path must be a file path; got {type(path).__name__}.")
        self.path = os.fspath(path)
        self.stdout = stdout
        self._file: int | None = None
        self._said = False

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        r"""Appends a line for the summary and returns it unchanged."""
        expect(checkpoint, Checkpoint, "JsonLinesWriter")
        if not is_main_process():
            return checkpoint
        summary = as_summary(checkpoint)
        record: dict[str, Any] = {
            "step": int(summary.step),
            "time": time.time(),
            "elapsed_time": float(summary.elapsed_time),
            "n_completed_steps": int(summary.n_completed_steps),
            "preempted": bool(summary.preempted),
        }
        for group, metrics in summary.metrics.items():
            for name, value in metrics.items():
                record[f"{group}/{name}"] = _json_value(f"{group}/{name}", value)
        line = (json.dumps(record, allow_nan=False) + "\n").encode("utf-8")
        if not self._said:
            self._said = True
            self._say_earlier_lines()
        descriptor = self._open()
        size = os.fstat(descriptor).st_size
        if size and os.pread(descriptor, 1, size - 1) != b"\n":
            # an earlier writer's last line was cut: it stays a line of its
            # own, and this record one that `json` and pandas read
            line = b"\n" + line
        try:
            written = 0
            while written < len(line):
                written += os.write(descriptor, line[written:])
        except OSError as error:
            try:
                os.ftruncate(descriptor, size)  # no partial line left behind
            except OSError:
                pass
            raise CheckpointError(
                f"Cannot append step {record['step']}'s line to {self.path!r}: {error}. "
                "The lines already there are intact."
            ) from None
        return checkpoint

    def _say_earlier_lines(self) -> None:
        r"""One line when the file holds an earlier run's lines (appended to)."""
        try:
            with open(self.path, "rb") as earlier:
                content = earlier.read()
        except OSError:
            return
        lines = [line for line in content.split(b"\n") if line.strip()]
        if not lines:
            return
        try:
            last = json.loads(lines[-1].decode("utf-8")).get("step")
        except (ValueError, AttributeError):
            last = None
        at = f", the last of step {last:,}" if isinstance(last, int) else ""
        cut = (
            " (its last line is cut or unreadable: the next record starts a line of its own)"
            if last is None or not content.endswith(b"\n")
            else ""
        )
        log(
            f"appending to {self.path}, which holds {len(lines):,} lines of an earlier "
            f"run{at}{cut}.",
            self.stdout,
            lead="JsonLinesWriter:",
        )

    def _open(self) -> int:
        if self._file is None:
            directory = os.path.dirname(self.path)
            try:
                if directory:
                    os.makedirs(directory, exist_ok=True)
                self._file = os.open(
                    self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
                )
            except OSError as error:
                raise CheckpointError(
                    f"Cannot open {self.path!r} for appending: {error}."
                ) from None
        return self._file

    def close(self) -> None:
        r"""Closes the file (it is reopened by the next write)."""
        if self._file is not None:
            os.close(self._file)
            self._file = None

    def __enter__(self) -> "JsonLinesWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _json_value(name: str, value: Any) -> Any:
    r"""A metric as JSON takes it: a number, a (nested) list of numbers, a
    string or a bool; `None` and non-finite numbers as `null`.

    >>> _json_value("eval/per_class", np.array([0.5, np.nan]))
    [0.5, None]
    """
    if value is None or isinstance(value, (str, bool)):
        return value
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise MetricError(
            f"The metric {name!r} is {type(value).__name__} {value!r:.80}, which a JSON "
            "line cannot hold: give numbers, arrays of numbers, strings or None."
        ) from None
    if array.ndim == 0:
        number = float(array)
        return number if math.isfinite(number) else None
    return _finite_or_none(array.tolist())


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, list):
        return [_finite_or_none(item) for item in value]
    return value if math.isfinite(value) else None
