r"""Checkpoints: the state a loop yields, its files, and their readers and writers."""

from flax_loop.checkpoint._best import (
    HighestCheckpointFileReader,
    HighestCheckpointFileWriter,
    LowestCheckpointFileReader,
    LowestCheckpointFileWriter,
)
from flax_loop.checkpoint._checkpoint import Checkpoint, Metrics, Summary, expect
from flax_loop.checkpoint._file import CheckpointFile
from flax_loop.checkpoint._inventory import (
    CheckpointContents,
    CheckpointEntry,
    list_checkpoints,
    read_contents,
)
from flax_loop.checkpoint._orbax import (
    HighestOrbaxCheckpointWriter,
    LowestOrbaxCheckpointWriter,
    OrbaxCheckpointReader,
    OrbaxCheckpointWriter,
)
from flax_loop.checkpoint._reader import CheckpointFileReader
from flax_loop.checkpoint._saved import Saved, SavedState
from flax_loop.checkpoint._summary import as_summary, summarize, train_statistics
from flax_loop.checkpoint._writer import CheckpointFileWriter

# `SummaryLogger` and `SummaryWriter` are output, not checkpoints, and live in
# `flax_loop.console` and `flax_loop.tensorboard`; `flax_loop/__init__.py`
# also offers them here, where flax-extra programs import them from.
__all__ = [
    "Checkpoint",
    "CheckpointContents",
    "CheckpointEntry",
    "CheckpointFile",
    "CheckpointFileReader",
    "CheckpointFileWriter",
    "HighestCheckpointFileReader",
    "HighestCheckpointFileWriter",
    "LowestCheckpointFileReader",
    "LowestCheckpointFileWriter",
    "HighestOrbaxCheckpointWriter",
    "LowestOrbaxCheckpointWriter",
    "Metrics",
    "OrbaxCheckpointReader",
    "OrbaxCheckpointWriter",
    "Saved",
    "SavedState",
    "Summary",
    "as_summary",
    "expect",
    "list_checkpoints",
    "read_contents",
    "summarize",
    "train_statistics",
]
