r"""Checkpoints: the state a loop yields, its files, and their readers and writers."""

# Names are imported when first used (PEP 562, as in `flax_loop`): listing
# files (`list_checkpoints`, `read_contents`) loads neither JAX nor Orbax.
from typing import TYPE_CHECKING

from flax_loop._lazy import lazy

if TYPE_CHECKING:
    from flax_loop.checkpoint._arriving import arriving as arriving
    from flax_loop.checkpoint._arriving import settle as settle
    from flax_loop.checkpoint._best import (
        HighestCheckpointFileReader,
        HighestCheckpointFileWriter,
        LowestCheckpointFileReader,
        LowestCheckpointFileWriter,
    )
    from flax_loop.checkpoint._checkpoint import (
        Checkpoint,
        CheckpointFile,
        Metrics,
        Saved,
        SavedState,
        Summary,
        expect,
    )
    from flax_loop.checkpoint._frozen import digest as digest
    from flax_loop.checkpoint._frozen import flatten as flatten
    from flax_loop.checkpoint._frozen import put_back as put_back
    from flax_loop.checkpoint._frozen import taken_from as taken_from
    from flax_loop.checkpoint._inventory import (
        CheckpointContents,
        CheckpointEntry,
        list_checkpoints,
        read_contents,
        read_damaged,
    )
    from flax_loop.checkpoint._orbax import (
        HighestOrbaxCheckpointWriter,
        LowestOrbaxCheckpointWriter,
        OrbaxCheckpointWriter,
    )
    from flax_loop.checkpoint._orbax_reader import OrbaxCheckpointReader
    from flax_loop.checkpoint._reader import CheckpointFileReader
    from flax_loop.checkpoint._summary import as_summary, summarize, train_statistics
    from flax_loop.checkpoint._summary import goodput as goodput
    from flax_loop.checkpoint._writer import CheckpointFileWriter

_HOMES = {
    "HighestCheckpointFileReader": "flax_loop.checkpoint._best",
    "HighestCheckpointFileWriter": "flax_loop.checkpoint._best",
    "LowestCheckpointFileReader": "flax_loop.checkpoint._best",
    "LowestCheckpointFileWriter": "flax_loop.checkpoint._best",
    "Checkpoint": "flax_loop.checkpoint._checkpoint",
    "Metrics": "flax_loop.checkpoint._checkpoint",
    "Summary": "flax_loop.checkpoint._checkpoint",
    "expect": "flax_loop.checkpoint._checkpoint",
    "CheckpointFile": "flax_loop.checkpoint._checkpoint",
    "CheckpointContents": "flax_loop.checkpoint._inventory",
    "CheckpointEntry": "flax_loop.checkpoint._inventory",
    "list_checkpoints": "flax_loop.checkpoint._inventory",
    "read_contents": "flax_loop.checkpoint._inventory",
    "read_damaged": "flax_loop.checkpoint._inventory",
    "HighestOrbaxCheckpointWriter": "flax_loop.checkpoint._orbax",
    "LowestOrbaxCheckpointWriter": "flax_loop.checkpoint._orbax",
    "OrbaxCheckpointReader": "flax_loop.checkpoint._orbax_reader",
    "OrbaxCheckpointWriter": "flax_loop.checkpoint._orbax",
    "CheckpointFileReader": "flax_loop.checkpoint._reader",
    "Saved": "flax_loop.checkpoint._checkpoint",
    "SavedState": "flax_loop.checkpoint._checkpoint",
    "as_summary": "flax_loop.checkpoint._summary",
    # for the layers above and the tests (set-up puts frozen parameters back
    # and checks their digest, the meter reports goodput, an interval's
    # statistics arrive after its checkpoint); not part of the
    # documented API
    "put_back": "flax_loop.checkpoint._frozen",
    "arriving": "flax_loop.checkpoint._arriving",
    "settle": "flax_loop.checkpoint._arriving",
    "digest": "flax_loop.checkpoint._frozen",
    "flatten": "flax_loop.checkpoint._frozen",
    "taken_from": "flax_loop.checkpoint._frozen",
    "goodput": "flax_loop.checkpoint._summary",
    "summarize": "flax_loop.checkpoint._summary",
    "train_statistics": "flax_loop.checkpoint._summary",
    "CheckpointFileWriter": "flax_loop.checkpoint._writer",
}


__getattr__, __dir__ = lazy("flax_loop.checkpoint", globals(), _HOMES)

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
    "read_damaged",
    "summarize",
    "train_statistics",
]
