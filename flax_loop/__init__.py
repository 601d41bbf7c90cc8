r"""flax_loop: an iterator-style managed training loop for JAX, Flax and Optax.

>>> task = TrainTask(apply=model.apply, optimizer=optax.adam(1e-3),
...                  loss=cross_entropy, data=batches)
>>> for checkpoint in TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
...                             n_steps=20, n_steps_per_checkpoint=10, stdout=False):
...     print(checkpoint.step, checkpoint.mean_loss < 5)
10 True
20 True
"""

from flax_loop import checkpoint as _checkpoint_package
from flax_loop import errors, random
from flax_loop.checkpoint import (
    Checkpoint,
    CheckpointFile,
    CheckpointFileReader,
    CheckpointFileWriter,
    HighestCheckpointFileReader,
    HighestCheckpointFileWriter,
    HighestOrbaxCheckpointWriter,
    LowestCheckpointFileReader,
    LowestCheckpointFileWriter,
    LowestOrbaxCheckpointWriter,
    Metrics,
    OrbaxCheckpointReader,
    OrbaxCheckpointWriter,
    SavedState,
    Summary,
)
from flax_loop.console import SummaryLogger
from flax_loop.distributed import initialize_processes
from flax_loop.errors import FlaxLoopError
from flax_loop.evaluation import EvalLoop
from flax_loop.jsonlines import JsonLinesWriter
from flax_loop.log import set_console
from flax_loop.loop import TrainLoop
from flax_loop.metric_store import MLflowWriter
from flax_loop.parallel import DATA_AXIS
from flax_loop.profiling import ProfileSteps
from flax_loop.task import EvalTask, TrainTask
from flax_loop.tensorboard import SummaryWriter
from flax_loop.version import __version__

# flax-extra programs import the summary processors from the checkpoint
# package; they are output and live with it, so they are offered there from
# here rather than imported by it.
_checkpoint_package.SummaryLogger = SummaryLogger  # type: ignore[attr-defined]
_checkpoint_package.SummaryWriter = SummaryWriter  # type: ignore[attr-defined]

__all__ = [
    "DATA_AXIS",
    "Checkpoint",
    "CheckpointFile",
    "CheckpointFileReader",
    "CheckpointFileWriter",
    "EvalLoop",
    "EvalTask",
    "FlaxLoopError",
    "HighestCheckpointFileReader",
    "HighestCheckpointFileWriter",
    "HighestOrbaxCheckpointWriter",
    "JsonLinesWriter",
    "LowestCheckpointFileReader",
    "LowestCheckpointFileWriter",
    "LowestOrbaxCheckpointWriter",
    "MLflowWriter",
    "Metrics",
    "OrbaxCheckpointReader",
    "OrbaxCheckpointWriter",
    "ProfileSteps",
    "SavedState",
    "Summary",
    "SummaryLogger",
    "SummaryWriter",
    "TrainLoop",
    "TrainTask",
    "__version__",
    "errors",
    "initialize_processes",
    "random",
    "set_console",
]
