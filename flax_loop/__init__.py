r"""flax_loop: an iterator-style managed training loop for JAX, Flax and Optax.

>>> task = TrainTask(apply=model.apply, optimizer=optax.adam(1e-3),
...                  loss=loss, data=batches)
>>> for checkpoint in TrainLoop(init=model.init, task=task,
...                             rnkey=jax.random.key(0), n_steps=1000,
...                             n_steps_per_checkpoint=100):
...     print(checkpoint.step, checkpoint.mean_loss)
"""

from flax_loop import errors, random
from flax_loop.checkpoint import (
    Checkpoint,
    CheckpointFile,
    CheckpointFileReader,
    CheckpointFileWriter,
    HighestCheckpointFileReader,
    HighestCheckpointFileWriter,
    LowestCheckpointFileReader,
    LowestCheckpointFileWriter,
    Metrics,
    Summary,
)
from flax_loop.console import SummaryLogger
from flax_loop.errors import FlaxLoopError
from flax_loop.evaluation import EvalLoop
from flax_loop.loop import TrainLoop
from flax_loop.task import EvalTask, TrainTask
from flax_loop.tensorboard import SummaryWriter
from flax_loop.version import __version__

__all__ = [
    "Checkpoint",
    "CheckpointFile",
    "CheckpointFileReader",
    "CheckpointFileWriter",
    "EvalLoop",
    "EvalTask",
    "FlaxLoopError",
    "HighestCheckpointFileReader",
    "HighestCheckpointFileWriter",
    "LowestCheckpointFileReader",
    "LowestCheckpointFileWriter",
    "Metrics",
    "Summary",
    "SummaryLogger",
    "SummaryWriter",
    "TrainLoop",
    "TrainTask",
    "__version__",
    "errors",
    "random",
]
