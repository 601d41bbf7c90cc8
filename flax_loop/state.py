r"""The training state the compiled step carries, and an interval's statistics.

>>> state = TrainState.create({"w": jnp.ones(3)}, {}, (), step=5)
>>> int(state.step), float(state.loss_sum)
(5, 0.0)
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from flax_loop.checkpoint import Saved


class TrainState(NamedTuple):
    r"""Everything the update carries from one step to the next.

    It lives on the devices, replicated, and is donated to each step. A
    NamedTuple, whose pytree handling is the fastest JAX has. The
    gradients are not part of it: carrying them from step to step forces XLA
    to materialize them apart from the optimizer's update, which cost 30% of
    a small MLP's step here; the last step of an interval returns them.
    """

    counters: jax.Array
    r"""int32[3]: the number of completed steps; since the last checkpoint, the
    number of steps whose loss (or, when skipping, gradient) was not finite
    and the first such step (0 if none). One array, not three: every leaf
    a step passes costs the host a fixed amount."""

    model_params: Any
    r"""the model's parameters."""

    model_state: Any
    r"""the model's other collections (e.g. `batch_stats`)."""

    optimizer_state: Any
    r"""the optimizer's state."""

    loss_sum: jax.Array
    r"""the sum of the finite losses since the last checkpoint."""

    metric_sums: Any = None
    r"""the sums of the loss function's extra metrics (`loss -> (loss,
    {name: value})`) over the finite steps since the last checkpoint; `{}`
    for a loss without them."""

    ema_params: Any = None
    r"""the exponential moving average of the parameters (`TrainLoop(ema_decay=...)`);
    `None` without one."""

    def saved_arrays(self) -> dict[str, Any]:
        r"""`{name: tree}` of the saved state's array fields (`Saved.ARRAYS`):
        what a checkpoint copies."""
        return {name: getattr(self, name) for name in Saved.ARRAYS}

    @property
    def step(self) -> jax.Array:
        r"""the number of completed steps."""
        return self.counters[0]

    @classmethod
    def of(cls, saved: Saved, step: int) -> "TrainState":
        r"""The state of a saved state's arrays (any form of it) at `step`."""
        return cls.create(**saved.arrays(), step=step)

    @classmethod
    def create(
        cls,
        model_params: Any,
        model_state: Any,
        optimizer_state: Any,
        step: int,
        ema_params: Any = None,
    ) -> "TrainState":
        r"""A state at `step`, with empty interval sums."""
        return cls(
            counters=jnp.asarray([step, 0, 0], jnp.int32),
            model_params=model_params,
            model_state=model_state,
            optimizer_state=optimizer_state,
            loss_sum=jnp.zeros((), jnp.float32),
            metric_sums={},
            ema_params=ema_params,
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


def close_interval(state: TrainState, grads: Any) -> tuple[TrainState, IntervalStatistics]:
    r"""The interval's statistics, and the state with its interval sums reset.

    >>> import jax.numpy as jnp
    >>> params = {"w": jnp.ones(3)}
    >>> state = TrainState.create(params, {}, (), step=0)._replace(
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


def all_finite(tree: Any) -> jax.Array:
    r"""Whether every floating-point value of a pytree is finite.

    >>> bool(all_finite({"w": jnp.ones(3), "count": jnp.zeros((), jnp.int32)}))
    True
    >>> bool(all_finite([jnp.array([1.0, jnp.nan])]))
    False
    """
    leaves = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)
