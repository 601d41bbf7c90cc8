r"""The step as a value (`Step`: its carried fields, `init` and `update`), its
transforms, and the step a `TrainTask` describes (`flax_loop.step.build`)."""

from flax_loop.step.core import CORE, Context, Field, Outcome, Step, chain
from flax_loop.step.core import Transform as Transform

__all__ = ["CORE", "Context", "Field", "Outcome", "Step", "chain"]
