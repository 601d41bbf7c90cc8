r"""Checkpoints: the state a loop yields, its files, and their readers and writers."""

from typing import Any

from flax_loop.checkpoint._best import (
    HighestCheckpointFileReader,
    HighestCheckpointFileWriter,
    LowestCheckpointFileReader,
    LowestCheckpointFileWriter,
)
from flax_loop.checkpoint._checkpoint import Checkpoint, Metrics, Summary
from flax_loop.checkpoint._file import CheckpointFile
from flax_loop.checkpoint._reader import CheckpointFileReader
from flax_loop.checkpoint._writer import CheckpointFileWriter

__all__ = [
    "Checkpoint",
    "CheckpointFile",
    "CheckpointFileReader",
    "CheckpointFileWriter",
    "HighestCheckpointFileReader",
    "HighestCheckpointFileWriter",
    "LowestCheckpointFileReader",
    "LowestCheckpointFileWriter",
    "Metrics",
    "Summary",
    "SummaryLogger",
    "SummaryWriter",
]


def __getattr__(name: str) -> Any:
    # The summary processors live in their own modules (console, tensorboard),
    # which import this package; they are offered here lazily so that
    # `from flax_loop.checkpoint import SummaryLogger` keeps working.
    if name == "SummaryLogger":
        from flax_loop.console import SummaryLogger

        return SummaryLogger
    if name == "SummaryWriter":
        from flax_loop.tensorboard import SummaryWriter

        return SummaryWriter
    raise AttributeError(f"module 'flax_loop.checkpoint' has no attribute {name!r}")
