r"""Training API: `TrainTask` and `TrainLoop` (also importable from `flax_loop`)."""

from flax_loop.loop import TrainLoop
from flax_loop.task import TrainTask

__all__ = ["TrainLoop", "TrainTask"]
