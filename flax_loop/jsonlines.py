r"""`JsonLinesWriter`: summaries as JSON lines, one object per checkpoint.

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
from typing import IO, Any

from flax_loop.checkpoint import Checkpoint, as_summary, expect
from flax_loop.errors import CheckpointError, ConfigError
from flax_loop.log import is_main_process


class JsonLinesWriter:
    r"""Appends each summary (or checkpoint) to a JSON-lines file, flushed at once.

    Each line holds `step`, `time` (seconds since the epoch), `elapsed_time`,
    `n_completed_steps`, `preempted`, and every metric as `"group/name"`
    (non-finite values as `null`). A file from an earlier run is appended
    to. Only process 0 writes.

    Args:
        path: the file to append to (its directory is created).
    """

    def __init__(self, path: str) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"path must be a file path; got {type(path).__name__}.")
        self.path = os.fspath(path)
        self._file: IO[str] | None = None

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
                number = float(value)
                record[f"{group}/{name}"] = number if math.isfinite(number) else None
        stream = self._open()
        stream.write(json.dumps(record) + "\n")
        stream.flush()
        return checkpoint

    def _open(self) -> IO[str]:
        if self._file is None:
            directory = os.path.dirname(self.path)
            try:
                if directory:
                    os.makedirs(directory, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            except OSError as error:
                raise CheckpointError(
                    f"Cannot open {self.path!r} for appending: {error}."
                ) from error
        return self._file

    def close(self) -> None:
        r"""Closes the file (it is reopened by the next write)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "JsonLinesWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
