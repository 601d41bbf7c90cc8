r"""The end of an interval: its statistics read once, the non-finite check,
the `Checkpoint`, its rates and where its time went.

The loop runs steps; at each checkpoint `Intervals.close` copies the state
(the copies outlive the loop's donated buffers), closes the interval on the
devices (one host transfer of its statistics), raises for non-finite values
and assembles the `Checkpoint` with the data state of that moment; the
run's meters (`Throughput`, `TimeBreakdown`, set up and described in
`flax_loop.run.throughput`) add its rates and its time by part.
"""

import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flax_loop.checkpoint import Checkpoint, SavedState
from flax_loop.data.feed import BatchFeed
from flax_loop.errors import ConfigError
from flax_loop.parallel import Placement, to_host
from flax_loop.programs.compiled import CompiledSteps
from flax_loop.programs.state import IntervalResult, IntervalStatistics, TrainState

CHUNK = 64
r"""Dispatches' losses stacked on the devices per host transfer."""

STACK_FROM = 8
r"""A checkpoint reads fewer pending losses than this one by one."""


@jax.jit
def _stacked(*losses: jax.Array) -> jax.Array:
    return jnp.stack(losses)


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
    >>> history.read()[[0, 63, 64, 69, 71, 75]]
    array([ 0., 63., 64., 69., 71., 75.], dtype=float32)
    """

    def __init__(self) -> None:
        # (device array, how many of its rows count; None: all of it)
        self._parts: list[tuple[Any, int | None]] = []
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

    def read(self) -> np.ndarray:
        r"""The losses noted since the last read, in order, as float32; then
        starts again."""
        self._stack_pending()
        parts, self._parts = self._parts, []
        values = [
            np.reshape(np.asarray(array) if count is None else np.asarray(array)[:count], -1)
            for array, count in parts
        ]
        return np.concatenate(values).astype(np.float32) if values else np.zeros(0, np.float32)

    def _stack_pending(self) -> None:
        pending, self._pending = self._pending, []
        if len(pending) >= STACK_FROM:  # padded with the last: one compiled stack
            padding = [pending[-1]] * (CHUNK - len(pending))
            self._parts.append((_stacked(*pending, *padding), len(pending)))
        else:
            self._parts.extend((loss, None) for loss in pending)


class Intervals:
    r"""A loop's intervals between checkpoints.

    Args:
        steps: the compiled steps (their `copier` and `close_interval`).
        placement: the devices.
        feed: the data feed (its state goes into each checkpoint).
        rnkey: the run's key, stored with each checkpoint.
        raise_nonfinite: whether a non-finite loss or gradient raises.
        step: the step the first interval starts after.
        frozen: which parameters no optimizer trains (`Checkpoint.frozen`).
        mirrors_params: the carried fields that mirror the parameters
            (`Checkpoint.mirrors_params`).
        optimizer_names: the optimizers' names in the order a step runs them
            (`Checkpoint.optimizer_names`), or `None` for one.
    """

    def __init__(
        self,
        steps: CompiledSteps,
        placement: Placement,
        feed: BatchFeed,
        rnkey: jax.Array,
        raise_nonfinite: bool,
        step: int,
        frozen: Any = None,
        mirrors_params: tuple[str, ...] = (),
        optimizer_names: tuple[str, ...] | None = None,
    ) -> None:
        self._steps, self._placement, self._feed = steps, placement, feed
        self._frozen = frozen  # `Checkpoint.frozen`
        self._mirrors = mirrors_params  # `Checkpoint.mirrors_params`
        self._optimizer_names = optimizer_names  # `Checkpoint.optimizer_names`
        self.caller_state: dict[str, Any] = {}
        r"""`TrainLoop.caller_state`: every checkpoint holds this one dict, so
        a file holds it as the body left it when the file is written."""
        self._rnkey, self._raise_nonfinite = rnkey, raise_nonfinite
        self.start = step
        r"""the step the current interval started after."""
        self._grads: Any = None  # the last interval-ending step's
        self.losses = LossHistory()
        r"""the interval's losses as the steps returned them (the loop notes them)."""
        self._last: Checkpoint | None = None
        self._copy: Callable[[TrainState], dict[str, Any]] | None = None

    def close(
        self,
        state: TrainState,
        step: int,
        loss: Any,
        ending: tuple[Any, ...] | None,
        started: float,
        preempted: bool = False,
    ) -> tuple[TrainState, Checkpoint]:
        r"""The interval's checkpoint at `step`, and the state to go on with.

        `started` is the `time.perf_counter()` at which the interval's first
        dispatch began: its `elapsed_time` runs from there to the moment its
        statistics arrive, so it counts the devices' work on the interval's
        last steps too (dispatch runs ahead of them).

        `ending` is what the step that ended the interval returned, `(state,
        loss, grads, statistics)` (`statistics` `None` when it did not close
        the interval: a stream's shorter last batch), or `None` when no step
        ended it (the stream ended, or a stop came, between dispatches).

        Raises:
            NonFiniteError: if a loss or gradient of the interval was not
                finite and the loop was told to raise.
        """
        n_completed = step - self.start
        if self._copy is None:  # compiled in the background meanwhile
            self._copy = self._steps.copier()
        arrays = self._copy(state)
        params, optimizer_state = arrays["model_params"], arrays["optimizer_state"]
        history = self.losses.read()
        statistics = None
        if ending is not None:
            self._grads, statistics = ending[2], ending[3]
        elif self._grads is None:  # no step returned gradients yet (an interrupt ended it)
            self._grads = jax.tree.map(jnp.zeros_like, self._steps.grads_like(params))
        if n_completed:
            state, result = self._finish(state, loss, n_completed, statistics)
            if self._raise_nonfinite and (result.n_nonfinite or not result.finite):
                raise result.error(self.start, step)
            grads, loss_value = self._grads, result.loss
            n_nonfinite, mean_loss = result.n_nonfinite, result.mean_loss
            train_metrics = {
                "loss": mean_loss,
                **result.metrics,
                **hyperparameters(optimizer_state),
            }
        else:  # stopped before any step of this interval
            previous = self._last
            n_nonfinite, mean_loss, train_metrics = 0, float("nan"), {}
            grads = (
                previous.grads
                if previous
                else jax.tree.map(jnp.zeros_like, self._steps.grads_like(params))
            )
            loss_value = previous.loss if previous else float("nan")
        elapsed = time.perf_counter() - started  # after _finish's wait for the devices
        self.start = step
        self._last = Checkpoint.from_saved(
            self._saved(arrays, step),
            grads=grads,
            loss=loss_value,
            n_completed_steps=n_completed,
            elapsed_time=elapsed,
            mean_loss=mean_loss,
            n_nonfinite_steps=n_nonfinite,
            train_metrics=train_metrics,
            losses=history,
            preempted=preempted,
            frozen=self._frozen,
            mirrors_params=self._mirrors,
        )
        return state, self._last

    def _saved(self, arrays: dict[str, Any], step: int) -> SavedState:
        r"""The saved record at `step` of the state's copied `arrays`."""
        return SavedState(
            None,
            None,
            None,
            step=step,
            rnkey=self._rnkey,
            data_state=self._feed.state(step),
            caller_state=self.caller_state,
            optimizer_names=self._optimizer_names,
        ).with_arrays(arrays)

    def _finish(
        self,
        state: TrainState,
        loss: jax.Array,
        n_steps: int,
        statistics: IntervalStatistics | None,
    ) -> tuple[TrainState, IntervalResult]:
        r"""The interval's statistics on the host (the host's one wait for the
        devices in an interval), and the state with its interval sums reset.

        `statistics` are those the interval's closing step returned; without
        them (an interval ended by a stop request, the stream's end or a
        shorter last batch) the interval is closed here."""
        if statistics is None:
            state, statistics = self._steps.close_interval(state, self._grads)
        loss, (counters, loss_sum, metric_sums, finite) = to_host((loss, statistics))
        _, n_nonfinite, first_nonfinite = (int(count) for count in counters)
        n_finite = n_steps - n_nonfinite

        def mean(total: Any) -> float:
            return float(total) / n_finite if n_finite else float("nan")

        metrics = {name: mean(total) for name, total in metric_sums.items()}
        return state, IntervalResult(
            float(np.reshape(loss, -1)[-1]),
            mean(loss_sum),
            n_nonfinite,
            first_nonfinite,
            bool(finite),
            metrics,
        )


def hyperparameters(optimizer_state: Any) -> dict[str, float]:
    r"""The scalar hyperparameters of an `optax.inject_hyperparams` optimizer,
    as its last step used them (e.g. a schedule's `learning_rate`)."""
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
    return {name: float(value) for name, value in to_host(found).items()}


class Throughput:
    r"""A run's rates, from each interval's steps and seconds.

    Args:
        examples_per_step: the examples of one step over every process.
        tokens_per_step: its tokens, or `None` when not counted.
        n_devices: the devices a step runs on.
        peak_flops: one device's peak FLOP/s, or `None` when unknown.
        flops_of: the FLOPs of one step on one device from the compiled
            programs, or `None` (`flax_loop.run.throughput.step_flops`).
    """

    def __init__(
        self,
        examples_per_step: int,
        tokens_per_step: int | None,
        n_devices: int,
        peak_flops: float | None,
        flops_of: Callable[[Mapping[str, Any]], float | None] = lambda programs: None,
    ) -> None:
        self.examples_per_step = examples_per_step
        self.tokens_per_step = tokens_per_step
        self.n_devices, self._flops_of = n_devices, flops_of
        self.peak_flops = peak_flops
        self.flops_per_step: float | None = None
        r"""the FLOPs of one step over every device, once read."""

    @property
    def peak_flops(self) -> float | None:
        r"""one device's peak FLOP/s, or `None` when unknown."""
        return self._peak_flops

    @peak_flops.setter
    def peak_flops(self, value: float | None) -> None:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
        ):
            raise ConfigError(
                f"peak_flops must be one device's peak FLOP/s, a positive number such as "
                f"989e12, or None; got {value!r}."
            )
        self._peak_flops = value

    def read_flops(self, programs: Mapping[str, Any]) -> None:
        r"""Reads the step's FLOPs from the compiled programs, once."""
        if self.flops_per_step is None:
            per_device = self._flops_of(programs)
            if per_device is not None:
                self.flops_per_step = per_device * self.n_devices

    def measure(self, n_steps: int, seconds: float) -> dict[str, float]:
        r"""The rates of `n_steps` steps that took `seconds`: `examples_per_second`,
        `tokens_per_second` (when counted), `flops_per_step`,
        `flops_per_second_per_device` (when XLA counted them) and `mfu` (when
        the peak is known too); `{}` for an empty interval."""
        if n_steps <= 0 or seconds <= 0:
            return {}
        rates = {"examples_per_second": self.examples_per_step * n_steps / seconds}
        if self.tokens_per_step is not None:
            rates["tokens_per_second"] = self.tokens_per_step * n_steps / seconds
        if self.flops_per_step is not None:
            per_device = self.flops_per_step * n_steps / seconds / self.n_devices
            rates["flops_per_step"] = self.flops_per_step
            rates["flops_per_second_per_device"] = per_device
            if self.peak_flops:
                rates["mfu"] = per_device / self.peak_flops
        return rates


class TimeBreakdown:
    r"""The run's time by part: set-up, then each interval's added.

    Args:
        setup: seconds the loop's set-up took (initialization, restoring,
            compiling the first step).
        compile: those of them spent compiling.
        handed_out: when the caller's code started running (the end of
            set-up; `time.perf_counter()`, now by default).
    """

    def __init__(
        self, setup: float = 0.0, compile: float = 0.0, handed_out: float | None = None
    ) -> None:
        self._handed_out = time.perf_counter() if handed_out is None else handed_out
        self._totals = {"setup": max(setup - compile, 0.0), "compile": compile}
        self._totals.update({"data": 0.0, "device": 0.0, "caller": 0.0, "wall": setup})

    def close(
        self, started: float, ended: float, data: float, device: float, compiled: float
    ) -> dict[str, float]:
        r"""Adds an interval and returns its seconds by part.

        Args:
            started: when the loop was asked for the interval (the caller's
                code ran from the previous checkpoint until then).
            ended: when its checkpoint was ready (handed out to the caller).
            data: seconds the loop waited for batches.
            device: seconds it dispatched steps and waited for the devices,
                `compiled` included.
            compiled: seconds it compiled, or waited for a compilation.
        """
        interval = {
            "compile": compiled,
            "data": data,
            "device": max(device - compiled, 0.0),
            "caller": started - self._handed_out,
            "wall": ended - self._handed_out,
        }
        self._handed_out = ended
        for part, value in interval.items():
            self._totals[part] += value
        return interval

    def totals(self) -> dict[str, float]:
        r"""The run's seconds so far: `setup` (without its compiling), the
        parts (`flax_loop.run.throughput.PARTS`) and `wall`."""
        return dict(self._totals)
