r"""The step compiled at set-up: `compiled_at_set_up`.

Tracing runs the user's model and loss for the first time, so this is where
their mistakes surface. A flax_loop error found while tracing is made the
last word (`last_word`: JAX's note on the frames it removed dropped, the
traceback through the tracing internals cut); Python control flow on a
traced value becomes a `LossError` saying what to write instead; float
class labels are named (`refuse_float_labels`); any other error carries a
note with the first batch's shapes and dtypes. A step that names the batch
axis runs per device, and set-up says so.
"""

from collections.abc import Callable
from typing import Any

import jax

from flax_loop.data.feed import BatchFeed, DispatchPlan
from flax_loop.errors import FlaxLoopError, LossError, last_word
from flax_loop.log import log
from flax_loop.parallel import Placement
from flax_loop.programs.compiled import CompiledSteps
from flax_loop.programs.lowering import PER_DEVICE_MODES
from flax_loop.programs.state import TrainState
from flax_loop.programs.statistics import counted
from flax_loop.run.layout import StepLayout, per_device_note
from flax_loop.step.model import refuse_float_labels
from flax_loop.step.objective import Objective


def compiled_at_set_up(
    layout: StepLayout,
    placement: Placement,
    state: TrainState,
    feed: BatchFeed,
    step_key: Any,
    plan: DispatchPlan,
    shardings: TrainState | None,
    objective: Objective,
    interrupted: Callable[[], bool] | None,
    defer: bool = False,
    stdout: bool = True,
) -> CompiledSteps:
    r"""The step compiled for the plan's first dispatch (the others compiling
    behind it), saying so when it runs per device; an error raised while
    tracing says what the step was traced with."""
    try:
        steps = CompiledSteps(
            counted(layout.step),
            placement,
            state,
            feed.sample_batch,
            step_key,
            plan,
            shardings,
            objective.grads_like,
            interrupted,
            defer,
            layout.program_key,
            lambda: counted(layout.per_device(shardings is not None)),
        )
    except (jax.errors.TracerBoolConversionError, jax.errors.ConcretizationTypeError) as error:
        first = str(error).strip().splitlines()[0]
        raise LossError(
            f"The step is traced and compiled, so Python control flow cannot depend on "
            f"its values ({type(error).__name__}: {first}). Write a choice that depends "
            "on a value, the step's number `step` included, with jnp.where(...) or "
            "jax.lax.cond(...), and a loop with jax.lax.fori_loop(...)."
        ) from None
    except Exception as error:
        if isinstance(error, TypeError):
            try:
                refuse_float_labels(error, getattr(feed.spec, "targets", ()))
            except FlaxLoopError as refused:
                raise last_word(refused) from None
        if isinstance(error, FlaxLoopError):  # its message is the last word
            raise last_word(error) from None
        error.add_note(
            "flax_loop: raised while tracing the training step (the model and "
            f"the loss) on the first batch: {feed.spec.describe()}."
        )
        raise
    if steps.mode in PER_DEVICE_MODES and placement.n_devices > 1:
        log(per_device_note(placement.batch_axis), stdout, lead="Note:", style="yellow")
    return steps
