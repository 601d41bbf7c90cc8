r"""Keeping the checkpoint with the lowest or highest value of a metric."""

import abc
import math
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from flax_loop.checkpoint._checkpoint import Summary, expect
from flax_loop.checkpoint._names import one_directory
from flax_loop.checkpoint._reader import CheckpointFileReader
from flax_loop.checkpoint._writer import CheckpointFileWriter
from flax_loop.checkpoint.format import quote
from flax_loop.errors import ConfigError, MetricError
from flax_loop.log import log


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
    value = values[metric]
    if isinstance(value, (str, bytes, bool)) or np.ndim(value) != 0:
        raise MetricError(
            f"{where}'s metric {group}/{metric} must be one real number; got "
            f"{value!r:.60} ({type(value).__name__}). Make the metric return a "
            "scalar (e.g. a mean)."
        )
    try:
        number = float(value)
    except (TypeError, ValueError) as error:
        raise MetricError(
            f"{where}'s metric {group}/{metric} must be one real number; got "
            f"{value!r:.60} ({type(value).__name__})."
        ) from error
    return number


def check_best_arguments(owner: str, metric: Any, group: Any, output_dir: Any) -> None:
    r"""A `ConfigError` for a best-metric writer's missing or empty argument."""
    if output_dir is None:
        raise ConfigError(f"{owner} needs output_dir, the directory to write to.")
    for name, value in (("metric", metric), ("group", group)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{name} must be a non-empty string; got {value!r}.")


class KeepsBest(abc.ABC):
    r"""What a best-metric writer adds to its writer: the metric, the best value
    so far, and writing a summary only when it beats it (`_write_best`)."""

    _kind = ""
    _initial = math.nan
    _better: Any
    metric: str
    group: str
    output_dir: str

    def _start_from(self, stored_metrics: Any, where: str | None, stdout: bool) -> None:
        r"""Sets the best value from the newest stored checkpoint (`where`; `None`: none)."""
        self._best_metric: float = self._initial
        if where is not None:
            self._best_metric = read_metric(stored_metrics, self.group, self.metric, where)
        log(
            f"The {self._kind} value of {self.group}/{self.metric} so far is "
            f"{self._best_metric:.8g}."
            if where is not None
            else f"No checkpoint of the {self._kind} {self.group}/{self.metric} yet in "
            f"{self.output_dir}.",
            stdout=stdout,
        )

    @property
    def best_metric(self) -> float:
        r"""the best value of the metric seen so far (in the directory too)."""
        return self._best_metric

    def is_best(self, value: float) -> bool:
        r"""Whether `value` beats the best value so far."""
        return bool(self._better(value, self._best_metric))

    @abc.abstractmethod
    def _write_best(self, summary: Summary) -> None:
        r"""Writes a summary that beats the best so far (the writer's own way)."""

    def __call__(self, summary: Summary) -> Summary:
        r"""Writes the summary if its metric is the best so far; returns it."""
        expect(summary, Summary, type(self).__name__)
        value = read_metric(summary.metrics, self.group, self.metric, "The summary")
        if self.is_best(value):
            self._write_best(summary)
            self._best_metric = value
        return summary


class _BestCheckpointFileWriter(KeepsBest, CheckpointFileWriter):  # type: ignore[misc]
    _reader_type: type["_BestCheckpointFileReader"]

    def __init__(
        self,
        metric: str,
        group: str = "eval",
        stdout: bool = True,
        output_dir: str | None = None,
        keep: int = 1,
        overwrite: bool | None = None,
        *,
        background: bool = False,
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
        stored = self._reader_type(
            dir=self.output_dir, target=None, metric=metric, group=group
        ).read_newest()
        where = None if stored is None else str(stored.path)
        self._start_from(None if stored is None else stored.metrics, where, stdout)

    def _write_best(self, summary: Summary) -> None:
        self.write(summary, self._prefix())


class LowestCheckpointFileWriter(_BestCheckpointFileWriter):
    r"""Keeps the checkpoint with the lowest value of `metrics[group][metric]`.

    >>> import pathlib, tempfile
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> writer = LowestCheckpointFileWriter(output_dir=str(tmp), metric="loss", stdout=False)
    >>> writer.best_metric
    inf
    """

    _kind = "lowest"
    _initial = math.inf
    _better = staticmethod(operator.lt)

    def _prefix(self) -> str:
        return lowest_checkpoint_prefix(self.group, self.metric)


class HighestCheckpointFileWriter(_BestCheckpointFileWriter):
    r"""Keeps the checkpoint with the highest value of `metrics[group][metric]`.

    >>> import pathlib, tempfile
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> def accuracy(logits, labels):
    ...     return (logits.argmax(-1) == labels).mean()
    >>> writer = HighestCheckpointFileWriter(output_dir=str(tmp), metric="accuracy", stdout=False)
    >>> writer.is_best(0.5)
    True
    """

    _kind = "highest"
    _initial = -math.inf
    _better = staticmethod(operator.gt)

    def _prefix(self) -> str:
        return highest_checkpoint_prefix(self.group, self.metric)


@dataclass
class _BestCheckpointFileReader(CheckpointFileReader):
    metric: str = None  # type: ignore[assignment]
    r"""a metric label."""

    group: str = "eval"
    r"""a group label."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, value in (("metric", self.metric), ("group", self.group)):
            if not isinstance(value, str) or not value:
                raise ConfigError(
                    f"{type(self).__name__}'s {name} must be a non-empty string; got {value!r}."
                )


@dataclass
class LowestCheckpointFileReader(_BestCheckpointFileReader):
    r"""Reads the checkpoint a `LowestCheckpointFileWriter` kept.

    >>> import flax.linen as nn
    >>> import pathlib, tempfile
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> model = nn.Dense(3)
    >>> reader = LowestCheckpointFileReader(dir=str(tmp), target=model.init, metric="loss")
    >>> reader.read_newest() is None
    True
    """

    def _prefix(self) -> str:
        return lowest_checkpoint_prefix(self.group, self.metric)


@dataclass
class HighestCheckpointFileReader(_BestCheckpointFileReader):
    r"""Reads the checkpoint a `HighestCheckpointFileWriter` kept."""

    def _prefix(self) -> str:
        return highest_checkpoint_prefix(self.group, self.metric)


LowestCheckpointFileWriter._reader_type = LowestCheckpointFileReader
HighestCheckpointFileWriter._reader_type = HighestCheckpointFileReader
