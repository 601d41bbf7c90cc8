r"""flax_loop: an iterator-style managed training loop for JAX, Flax and Optax.

>>> import jax
>>> import optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop import TrainLoop, TrainTask
>>> model = nn.Dense(3)
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
>>> task = TrainTask(apply=model.apply, optimizer=optax.adam(1e-3),
...                  loss=cross_entropy, data=batches)
>>> for checkpoint in TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
...                             n_steps=20, n_steps_per_checkpoint=10, stdout=False):
...     print(checkpoint.step, checkpoint.mean_loss < 5)
10 True
20 True
"""

# Public names are imported when first used (PEP 562), so that a program that
# needs only part of the package (the `flax-loop` command line listing files)
# does not load JAX; `import flax_loop` itself is instant.
from typing import TYPE_CHECKING

from flax_loop._lazy import lazy, offer

__version__ = "0.3.1.dev0"

if TYPE_CHECKING:
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
    from flax_loop.distributed import initialize_processes
    from flax_loop.errors import FlaxLoopError
    from flax_loop.evaluation import EvalLoop
    from flax_loop.log import set_console
    from flax_loop.loop import TrainLoop
    from flax_loop.output.console import SummaryLogger
    from flax_loop.output.jsonlines import JsonLinesWriter
    from flax_loop.output.metric_store import MLflowWriter
    from flax_loop.output.tensorboard import SummaryWriter
    from flax_loop.output.wandb_run import WandbWriter
    from flax_loop.parallel import DATA_AXIS
    from flax_loop.run.preemption import clear_stop
    from flax_loop.run.profiling import ProfileSteps
    from flax_loop.task import EvalTask, TrainTask

_HOMES = {
    "Checkpoint": "flax_loop.checkpoint",
    "CheckpointFile": "flax_loop.checkpoint",
    "CheckpointFileReader": "flax_loop.checkpoint",
    "CheckpointFileWriter": "flax_loop.checkpoint",
    "HighestCheckpointFileReader": "flax_loop.checkpoint",
    "HighestCheckpointFileWriter": "flax_loop.checkpoint",
    "HighestOrbaxCheckpointWriter": "flax_loop.checkpoint",
    "LowestCheckpointFileReader": "flax_loop.checkpoint",
    "LowestCheckpointFileWriter": "flax_loop.checkpoint",
    "LowestOrbaxCheckpointWriter": "flax_loop.checkpoint",
    "Metrics": "flax_loop.checkpoint",
    "OrbaxCheckpointReader": "flax_loop.checkpoint",
    "OrbaxCheckpointWriter": "flax_loop.checkpoint",
    "SavedState": "flax_loop.checkpoint",
    "Summary": "flax_loop.checkpoint",
    "SummaryLogger": "flax_loop.output.console",
    "initialize_processes": "flax_loop.distributed",
    "FlaxLoopError": "flax_loop.errors",
    "EvalLoop": "flax_loop.evaluation",
    "JsonLinesWriter": "flax_loop.output.jsonlines",
    "set_console": "flax_loop.log",
    "TrainLoop": "flax_loop.loop",
    "MLflowWriter": "flax_loop.output.metric_store",
    "DATA_AXIS": "flax_loop.parallel",
    "ProfileSteps": "flax_loop.run.profiling",
    "clear_stop": "flax_loop.run.preemption",
    "EvalTask": "flax_loop.task",
    "TrainTask": "flax_loop.task",
    "SummaryWriter": "flax_loop.output.tensorboard",
    "WandbWriter": "flax_loop.output.wandb_run",
}
_HOMES.update({name: f"flax_loop.{name}" for name in ("checkpoint", "errors", "random")})
# flax-extra programs import the summary writers from `flax_loop.checkpoint`:
# offered there from here, so that the checkpoint package names no output.
offer(
    "flax_loop.checkpoint",
    {
        "SummaryLogger": "flax_loop.output.console",
        "SummaryWriter": "flax_loop.output.tensorboard",
    },
)
__getattr__, __dir__ = lazy("flax_loop", globals(), _HOMES)

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
    "WandbWriter",
    "__version__",
    "clear_stop",
    "errors",
    "initialize_processes",
    "random",
    "set_console",
]
