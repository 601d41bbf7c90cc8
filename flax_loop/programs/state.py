r"""The training state the compiled step carries, and an interval's statistics.

>>> state = TrainState.create({"model_params": {"w": jnp.ones(3)}}, step=5)
>>> int(state.step), float(state.loss_sum)
(5, 0.0)
"""

from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from flax_loop.checkpoint import Saved
from flax_loop.errors import NonFiniteError
from flax_loop.step.nonfinite import all_finite


class TrainState(NamedTuple):
    r"""Everything the update carries from one step to the next.

    It lives on the devices, replicated or laid out, and is donated to each
    step. A NamedTuple, whose pytree handling is the fastest JAX has. The
    gradients are not part of it: carrying them from step to step forces XLA
    to materialize them apart from the optimizer's update, which slows a
    small model's step (`flax_loop.programs.lowering`'s closing step returns them).
    """

    counters: jax.Array
    r"""int32[3]; the number of completed steps; since the last checkpoint, the
    number of steps whose loss (or, when skipping, gradient) was not finite
    and the first such step (0 if none). One array, not three: every leaf
    a step passes costs the host a fixed amount."""

    fields: dict[str, Any]
    r"""the step's carried fields by name (`flax_loop.step.core`); the
    parameters, the model's other collections, the optimizer state, and
    those the step declares. What a checkpoint saves."""

    loss_sum: jax.Array
    r"""the sum of the finite losses since the last checkpoint."""

    metric_sums: Any = None
    r"""the sums of the step's training metrics over the finite steps since
    the last checkpoint; `{}` for a step without them."""

    @property
    def model_params(self) -> Any:
        r"""the model's parameters."""
        return self.fields["model_params"]

    @property
    def model_state(self) -> Any:
        r"""the model's other collections (e.g. `batch_stats`)."""
        return self.fields["model_state"]

    @property
    def optimizer_state(self) -> Any:
        r"""the optimizer's state."""
        return self.fields["optimizer_state"]

    def saved_arrays(self) -> dict[str, Any]:
        r"""`{name: tree}` of the carried fields: what a checkpoint copies."""
        return dict(self.fields)

    @property
    def step(self) -> jax.Array:
        r"""the number of completed steps."""
        return self.counters[0]

    @classmethod
    def of(cls, saved: Saved, step: int) -> "TrainState":
        r"""The state of a saved state's arrays (any form of it) at `step`."""
        return cls.create(saved.arrays(), step=step)

    @classmethod
    def create(cls, fields: Mapping[str, Any], step: int) -> "TrainState":
        r"""A state of `fields` at `step`, with empty interval sums."""
        return cls(
            # host values until the state is placed (no program run for them)
            counters=cast(jax.Array, np.asarray([step, 0, 0], np.int32)),
            fields=dict(fields),
            loss_sum=cast(jax.Array, np.zeros((), np.float32)),
            metric_sums={},
        )


class IntervalStatistics(NamedTuple):
    r"""What a checkpoint reports of its interval, computed on the devices."""

    counters: jax.Array
    r"""the state's counters at the end of the interval."""

    loss_sum: jax.Array
    r"""the sum of the interval's finite losses."""

    metric_sums: Any
    r"""the sums of the loss function's extra metrics over those steps."""

    finite: jax.Array
    r"""whether every parameter and the last step's gradients are finite."""


class IntervalResult(NamedTuple):
    r"""An interval's statistics on the host, as a checkpoint reports them."""

    loss: float
    r"""the last step's loss."""

    mean_loss: float
    r"""the mean of the interval's finite losses (NaN if none was finite)."""

    n_nonfinite: int
    r"""steps whose loss (or, when skipping, gradient) was not finite."""

    first_nonfinite: int
    r"""the first such step (0 if none)."""

    finite: bool
    r"""whether every parameter and the last step's gradients are finite."""

    metrics: dict[str, float]
    r"""the means of the loss function's extra metrics over the finite steps."""

    def error(self, start: int, step: int) -> NonFiniteError:
        r"""The error of this interval (after `start`, up to `step`) with a
        non-finite loss or gradient."""
        if self.first_nonfinite:
            # each step checks its loss; every gradient is checked at the checkpoint
            where = (
                f"the loss was NaN or infinite first at step {self.first_nonfinite} (a "
                "non-finite gradient of a step whose loss was finite shows in the next "
                f"step's loss: it may have come at step {max(self.first_nonfinite - 1, 1)})"
            )
        else:
            where = (
                f"a gradient or parameter was NaN or infinite between steps {start + 1} and {step}"
            )
        return NonFiniteError(
            f"Training went non-finite: {where}; detected at step {step}. Lower the "
            "learning rate, check the data for NaN or Inf, or pass nonfinite='skip' to "
            "TrainLoop to skip such updates."
        )


def close_interval(state: TrainState, grads: Any) -> tuple[TrainState, IntervalStatistics]:
    r"""The interval's statistics, and the state with its interval sums reset.

    >>> import jax.numpy as jnp
    >>> params = {"w": jnp.ones(3)}
    >>> state = TrainState.create({"model_params": params}, step=0)._replace(
    ...     counters=jnp.array([1, 0, 0], jnp.int32), loss_sum=jnp.float32(0.5))
    >>> grads = {"w": jnp.zeros(3)}
    >>> state, statistics = close_interval(state, grads)
    >>> int(statistics.counters[0]), float(state.loss_sum)
    (1, 0.0)
    """
    statistics = IntervalStatistics(
        counters=state.counters,
        loss_sum=state.loss_sum,
        metric_sums=state.metric_sums,
        finite=all_finite((state.model_params, grads)),
    )
    reset = state._replace(
        counters=state.counters.at[1:].set(0),
        loss_sum=jnp.zeros_like(state.loss_sum),
        metric_sums=jax.tree.map(jnp.zeros_like, state.metric_sums),
    )
    return reset, statistics
