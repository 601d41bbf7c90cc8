r"""Keeping the checkpoint with the lowest or highest value of a metric."""

import math
from dataclasses import dataclass
from typing import Any

from flax_loop import console
from flax_loop.checkpoint._checkpoint import Summary, expect
from flax_loop.checkpoint._file import CheckpointFile, quote
from flax_loop.checkpoint._reader import CheckpointFileReader
from flax_loop.checkpoint._writer import CheckpointFileWriter
from flax_loop.errors import ConfigError, MetricError


def lowest_checkpoint_prefix(group_label: str, metric_label: str) -> str:
    r"""The file-name prefix of a lowest-metric checkpoint."""
    return f"lowest.{quote(group_label)}.{quote(metric_label)}."


def highest_checkpoint_prefix(group_label: str, metric_label: str) -> str:
    r"""The file-name prefix of a highest-metric checkpoint."""
    return f"highest.{quote(group_label)}.{quote(metric_label)}."


def read_metric(metrics: Any, group: str, metric: str, where: str) -> float:
    r"""`metrics[group][metric]` as a float, or a `MetricError` naming what exists."""
    values = metrics.get(group) if hasattr(metrics, "get") else None
    if values is None:
        raise MetricError(
            f"{where} has no metric group {group!r} (it has "
            f"{sorted(metrics) if hasattr(metrics, 'keys') else metrics!r}); "
            "pass the group the metric is in, e.g. group='eval'."
        )
    if metric not in values:
        raise MetricError(
            f"{where} has no metric {group}/{metric} (group {group!r} has "
            f"{sorted(values)}); pass one of those as metric."
        )
    return float(values[metric])


class _BestCheckpointFileWriter(CheckpointFileWriter):
    _kind = ""
    _initial = math.nan

    def __init__(
        self,
        metric: str,
        group: str = "eval",
        stdout: bool = True,
        output_dir: str | None = None,
        keep: int = 1,
        overwrite: bool = True,
        *,
        background: bool = False,
    ) -> None:
        if output_dir is None:
            raise ConfigError(f"{type(self).__name__} needs output_dir, the directory to write to.")
        for name, value in (("metric", metric), ("group", group)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{name} must be a non-empty string; got {value!r}.")
        super().__init__(
            output_dir=output_dir, keep=keep, overwrite=overwrite, background=background
        )
        self.metric = metric
        self.group = group
        stored = CheckpointFileReader(dir=self.output_dir, target=None).read(  # type: ignore[arg-type]
            None, prefix=self._prefix()
        )
        self._best_metric: float = self._initial
        if isinstance(stored, dict):
            self._best_metric = read_metric(
                stored.get("metrics") or {}, group, metric, str(stored.get("path"))
            )
        console.log(
            f"The {self._kind} value of {group}/{metric} so far is {self._best_metric:.8g}."
            if isinstance(stored, dict)
            else f"No checkpoint of the {self._kind} {group}/{metric} yet in {self.output_dir}.",
            stdout=stdout,
        )

    @property
    def best_metric(self) -> float:
        r"""the best value of the metric seen so far (in files too)."""
        return self._best_metric

    def is_best(self, value: float) -> bool:
        raise NotImplementedError

    def __call__(self, summary: Summary) -> Summary:  # type: ignore[override]
        r"""Writes the summary if its metric is the best so far; returns it."""
        expect(summary, Summary, type(self).__name__)
        value = read_metric(summary.metrics, self.group, self.metric, "The summary")
        if self.is_best(value):
            self.write(summary, self._prefix())
            self._best_metric = value
        return summary


class LowestCheckpointFileWriter(_BestCheckpointFileWriter):
    r"""Keeps the checkpoint with the lowest value of `metrics[group][metric]`.

    >>> writer = LowestCheckpointFileWriter(output_dir="ckpts", metric="loss")
    """

    _kind = "lowest"
    _initial = math.inf

    def _prefix(self) -> str:
        return lowest_checkpoint_prefix(self.group, self.metric)

    def is_best(self, value: float) -> bool:
        return value < self._best_metric


class HighestCheckpointFileWriter(_BestCheckpointFileWriter):
    r"""Keeps the checkpoint with the highest value of `metrics[group][metric]`.

    >>> writer = HighestCheckpointFileWriter(output_dir="ckpts", metric="accuracy")
    """

    _kind = "highest"
    _initial = -math.inf

    def _prefix(self) -> str:
        return highest_checkpoint_prefix(self.group, self.metric)

    def is_best(self, value: float) -> bool:
        return value > self._best_metric


@dataclass
class LowestCheckpointFileReader(CheckpointFileReader):
    r"""Reads the checkpoint a `LowestCheckpointFileWriter` kept."""

    metric: str
    r"""a metric label."""

    group: str = "eval"
    r"""a group label."""

    def _prefix(self) -> str:
        return lowest_checkpoint_prefix(self.group, self.metric)

    def __call__(self, initializer: CheckpointFile) -> CheckpointFile:
        return self.read(initializer)  # type: ignore[return-value]


@dataclass
class HighestCheckpointFileReader(CheckpointFileReader):
    r"""Reads the checkpoint a `HighestCheckpointFileWriter` kept."""

    metric: str
    r"""a metric label."""

    group: str = "eval"
    r"""a group label."""

    def _prefix(self) -> str:
        return highest_checkpoint_prefix(self.group, self.metric)

    def __call__(self, initializer: CheckpointFile) -> CheckpointFile:
        return self.read(initializer)  # type: ignore[return-value]
