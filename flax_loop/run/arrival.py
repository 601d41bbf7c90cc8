r"""An interval's statistics on their way from the devices to the host.

An interval's close dispatches what its checkpoint needs (the state's copy,
the statistics' last reductions) and then waits for the devices to finish
the interval's steps before it can read a single number. That wait need not
hold up the caller's body: its evaluation, written as plain JAX calls on
`checkpoint.model_params`, may be dispatched while the devices still
compute the steps, as a hand-written loop's would be. So the loop can hand
a checkpoint out as soon as its arrays are dispatched and let its numbers
arrive on their own: an `Arrival` reads them on a thread of its own, which
notes when they came (the interval's `elapsed_time` ends there, not when
the body looked), and the checkpoint fills in its statistics from it the
first time one is asked for (`flax_loop.checkpoint.Checkpoint`).

The losses of the interval's steps are kept on the devices meanwhile, a
chunk of them stacked per host transfer (`LossHistory`).
"""

import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flax_loop.parallel import to_host
from flax_loop.programs.state import IntervalResult, IntervalStatistics

CHUNK = 64
r"""Dispatches' losses stacked on the devices per host transfer."""

STACK_FROM = 8
r"""A checkpoint reads fewer pending losses than this one by one."""


@jax.jit
def _stacked(*losses: jax.Array) -> jax.Array:
    return jnp.stack(losses)


LossParts = list[tuple[Any, int | None]]
r"""An interval's losses on the devices: (array, how many of its rows count;
`None`: all of it), in order."""


class LossHistory:
    r"""Every step's loss of an interval, kept on the devices, read at its checkpoint.

    Reading a device array costs the host as much as a small model's step,
    so the dispatches' losses (a scalar, or a vector for several steps a
    dispatch) are stacked on the devices in chunks of `CHUNK` (one cheap
    dispatch) and each chunk crosses to the host at once.

    >>> history = LossHistory()
    >>> for value in range(70):
    ...     history.append(jnp.float32(value))
    >>> history.extend(jnp.arange(70.0, 74.0))
    >>> history.extend(jnp.arange(74.0, 76.0))
    >>> losses(to_host(history.take()))[[0, 63, 64, 69, 71, 75]]
    array([ 0., 63., 64., 69., 71., 75.], dtype=float32)
    """

    def __init__(self) -> None:
        self._parts: LossParts = []
        self._pending: list[jax.Array] = []  # losses of one shape, not stacked yet
        self._shape: tuple[int, ...] = ()  # theirs: () or (steps a dispatch,)

    def append(self, loss: jax.Array) -> None:
        r"""Notes one step's loss (a scalar)."""
        if self._shape:
            self._stack_pending()
            self._shape = ()
        pending = self._pending
        pending.append(loss)
        if len(pending) == CHUNK:
            self._stack_pending()

    def extend(self, losses: jax.Array) -> None:
        r"""Notes one dispatch's losses of several steps (a vector)."""
        if losses.shape != self._shape:  # (the group that ends an interval may be shorter)
            self._stack_pending()
            self._shape = losses.shape
        self._pending.append(losses)
        if len(self._pending) == CHUNK:
            self._stack_pending()

    def take(self) -> LossParts:
        r"""The losses noted since the last take, still on the devices (read
        them with `losses(to_host(parts))`); then starts again."""
        self._stack_pending()
        parts, self._parts = self._parts, []
        return parts

    def _stack_pending(self) -> None:
        pending, self._pending = self._pending, []
        if len(pending) >= STACK_FROM:  # padded with the last: one compiled stack
            padding = [pending[-1]] * (CHUNK - len(pending))
            self._parts.append((_stacked(*pending, *padding), len(pending)))
        else:
            self._parts.extend((loss, None) for loss in pending)


def losses(parts: LossParts) -> np.ndarray:
    r"""The losses of `LossHistory.take`'s parts, read to the host, in order, as float32."""
    values = [np.reshape(array if count is None else array[:count], -1) for array, count in parts]
    return np.concatenate(values).astype(np.float32) if values else np.zeros(0, np.float32)


def interval_result(loss: Any, statistics: IntervalStatistics, n_steps: int) -> IntervalResult:
    r"""The result of an interval of `n_steps` steps from its last step's
    `loss` and its `statistics`, read to the host."""
    counters, loss_sum, metric_sums, finite = statistics
    _, n_nonfinite, first_nonfinite = (int(count) for count in counters)
    n_finite = n_steps - n_nonfinite

    def mean(total: Any) -> float:
        return float(total) / n_finite if n_finite else float("nan")

    return IntervalResult(
        float(np.reshape(loss, -1)[-1]),
        mean(loss_sum),
        n_nonfinite,
        first_nonfinite,
        bool(finite),
        {name: mean(total) for name, total in metric_sums.items()},
    )


def injected_hyperparameters(optimizer_state: Any) -> dict[str, Any]:
    r"""The scalar hyperparameters of an `optax.inject_hyperparams` optimizer,
    as its last step used them (e.g. a schedule's `learning_rate`), on the
    devices."""
    found: dict[str, Any] = {}
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    injected = [
        leaf
        for leaf in jax.tree.leaves(optimizer_state, is_leaf=lambda node: isinstance(node, kinds))
        if isinstance(leaf, kinds)
    ]
    for injected_state in injected:
        for name, value in injected_state.hyperparams.items():
            if np.ndim(value) == 0 and name not in found:
                found[name] = value
    return found


class Arrival:
    r"""Device values on their way to the host, and when they arrived.

    `later=False` reads them now, on the calling thread. `later=True` reads
    them on a thread of its own, started here, so that the caller goes on
    while the devices still compute them; `result()` waits for it.

    >>> arrival = Arrival({"loss": jnp.float32(2.0)}, later=True)
    >>> values, arrived = arrival.result()
    >>> float(values["loss"]), arrived <= time.perf_counter()
    (2.0, True)
    """

    def __init__(self, values: Any, later: bool) -> None:
        self._values: Any = values
        self._failed: Exception | None = None
        self.arrived = 0.0
        r"""`time.perf_counter()` when the values were on the host."""
        self._thread: threading.Thread | None = None
        if later:
            # Not a daemon: the interpreter waits for it at exit. A daemon
            # thread still reading when the interpreter shuts down is ended
            # inside JAX's C++ code, which aborts the process.
            self._thread = threading.Thread(target=self._read, name="arrival")
            self._thread.start()
        else:
            self._read()

    def _read(self) -> None:
        try:
            self._values = to_host(self._values)
        except Exception as error:  # raised where the values are asked for
            self._failed = error
        self.arrived = time.perf_counter()

    @property
    def pending(self) -> bool:
        r"""Whether the values are still on their way."""
        return self._thread is not None and self._thread.is_alive()

    def result(self) -> tuple[Any, float]:
        r"""The values on the host and when they arrived (waiting for them)."""
        if self._thread is not None:
            self._thread.join()
        if self._failed is not None:
            raise self._failed
        return self._values, self.arrived
