r"""The end of an interval: its statistics, the non-finite check, the
`Checkpoint`, its rates and where its time went.

The loop runs steps; at each checkpoint `Intervals.close` copies the state
(the copies outlive the loop's donated buffers), closes the interval on the
devices and assembles the `Checkpoint` with the data state of that moment.
Its statistics cross to the host in one transfer (`flax_loop.run.arrival`):
at once, or, when the loop hands the checkpoint out before the devices
finish (`later`), on their own thread while the caller's body runs; they
are filled in, the non-finite check raising, when first asked for and
before the next interval starts. The run's meters (`Throughput`,
`TimeBreakdown`, set up and described in `flax_loop.run.throughput`) add
its rates and its time by part.
"""

import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from flax_loop.checkpoint import Checkpoint, SavedState, arriving, settle
from flax_loop.data.feed import BatchFeed
from flax_loop.errors import ConfigError, NonFiniteError
from flax_loop.parallel import Placement
from flax_loop.programs.compiled import CompiledSteps
from flax_loop.programs.state import TrainState
from flax_loop.run.arrival import (
    Arrival,
    LossHistory,
    injected_hyperparameters,
    interval_result,
    losses,
)


class Intervals:
    r"""A loop's intervals between checkpoints.

    Args:
        steps: the compiled steps (their `copier` and `close_interval`).
        placement: the devices.
        feed: the data feed (its state goes into each checkpoint).
        rnkey: the run's key, stored with each checkpoint.
        raise_nonfinite: whether a non-finite loss or gradient raises.
        step: the step the first interval starts after.
        throughput: the run's rates, added to each checkpoint.
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
        throughput: "Throughput",
        frozen: Any = None,
        mirrors_params: tuple[str, ...] = (),
        optimizer_names: tuple[str, ...] | None = None,
    ) -> None:
        self._steps, self._placement, self._feed = steps, placement, feed
        self.throughput = throughput
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
        self.arrived = 0.0
        r"""when the last interval's statistics reached the host (`time.perf_counter()`)."""
        self._copy: Callable[[TrainState], dict[str, Any]] | None = None

    def close(
        self,
        state: TrainState,
        step: int,
        loss: Any,
        ending: tuple[Any, ...] | None,
        started: float,
        preempted: bool = False,
        later: bool = False,
        shown: Callable[[Checkpoint], None] | None = None,
    ) -> tuple[TrainState, Checkpoint]:
        r"""The interval's checkpoint at `step`, and the state to go on with.

        `started` is the `time.perf_counter()` at which the interval's first
        dispatch began: its `elapsed_time` runs from there (or from when
        the previous interval's statistics arrived, if later: the devices
        were busy until then) to the moment its statistics arrive, so it
        counts the devices' work on the interval's last steps too (dispatch
        runs ahead of them).

        `ending` is what the step that ended the interval returned, `(state,
        loss, grads, statistics)` (`statistics` `None` when it did not close
        the interval: a stream's shorter last batch), or `None` when no step
        ended it (the stream ended, or a stop came, between dispatches).

        With `later`, the checkpoint is returned before its statistics
        arrive (`settle`); else they are read here. `shown(checkpoint)` is
        called once they are in (the progress bar's update).

        Raises:
            NonFiniteError: if a loss or gradient of the interval was not
                finite and the loop was told to raise (when they are read).
        """
        n_completed = step - self.start
        if self._copy is None:  # compiled in the background meanwhile
            self._copy = self._steps.copier()
        arrays = self._copy(state)
        parts = self.losses.take()
        statistics = None
        if ending is not None:
            self._grads, statistics = ending[2], ending[3]
        elif self._grads is None:  # no step returned gradients yet (an interrupt ended it)
            self._grads = self._zero_grads(arrays)
        previous = self._last
        if n_completed and statistics is None:  # closed here (see `_fill`)
            state, statistics = self._steps.close_interval(state, self._grads)
        checkpoint = Checkpoint.from_saved(
            self._saved(arrays, step),
            grads=self._grads if n_completed else self._previous_grads(previous, arrays),
            loss=float("nan"),
            n_completed_steps=n_completed,
            elapsed_time=0.0,
            mean_loss=float("nan"),
            preempted=preempted,
            frozen=self._frozen,
            mirrors_params=self._mirrors,
        )
        if n_completed:
            hyperparameters = injected_hyperparameters(arrays["optimizer_state"])
            arrival = Arrival((loss, statistics, parts, hyperparameters), later)
            begun = max(started, self.arrived)
            arriving(checkpoint, self._fill(arrival, self.start, begun, shown))
        else:  # stopped before any step of this interval
            checkpoint.elapsed_time = time.perf_counter() - started
            if previous is not None:
                checkpoint.loss = previous.loss
            if shown is not None:
                shown(checkpoint)
        self.start = step
        if not later:
            settle(checkpoint)  # its NonFiniteError, raised here once
        self._last = checkpoint
        return state, checkpoint

    def settle(self) -> None:
        r"""Fills in the last checkpoint's statistics if they are on their way,
        waiting for the devices (before the next interval starts); raises
        its interval's `NonFiniteError`, once: a caller told of it may mend
        the state (`TrainLoop.update_state`) and train on."""
        last = self._last
        if last is not None:
            try:
                settle(last)
            except NonFiniteError:
                self._last = None
                raise

    def _fill(
        self,
        arrival: Arrival,
        start: int,
        begun: float,
        shown: Callable[[Checkpoint], None] | None,
    ) -> Callable[[Checkpoint], None]:
        r"""Fills a checkpoint's statistics in from `arrival` (of the interval
        after step `start`, its devices' work begun at `begun`), then shows
        them (`shown`)."""
        raised: list[Exception] = []

        def fill(checkpoint: Checkpoint) -> None:
            if raised:
                raise raised[0]
            (loss, statistics, parts, hyperparameters), arrived = arrival.result()
            self.arrived = max(self.arrived, arrived)
            n_steps, step = checkpoint.n_completed_steps, checkpoint.step
            result = interval_result(loss, statistics, n_steps)
            checkpoint.loss, checkpoint.mean_loss = result.loss, result.mean_loss
            checkpoint.n_nonfinite_steps = result.n_nonfinite
            checkpoint.losses = losses(parts)
            checkpoint.train_metrics = {
                "loss": result.mean_loss,
                **result.metrics,
                **{name: float(value) for name, value in hyperparameters.items()},
            }
            checkpoint.elapsed_time = arrived - begun
            self.throughput.read_flops(self._steps.programs)
            checkpoint.throughput = self.throughput.measure(n_steps, arrived - begun)
            if self._raise_nonfinite and (result.n_nonfinite or not result.finite):
                raised.append(result.error(start, step))
                raise raised[0]
            if shown is not None:
                shown(checkpoint)

        return fill

    def _zero_grads(self, arrays: dict[str, Any]) -> Any:
        return jax.tree.map(jnp.zeros_like, self._steps.grads_like(arrays["model_params"]))

    def _previous_grads(self, previous: Checkpoint | None, arrays: dict[str, Any]) -> Any:
        r"""A checkpoint of no steps' gradients: the previous one's, or zeros."""
        return previous.grads if previous is not None else self._zero_grads(arrays)

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
        self,
        started: float,
        ended: float,
        data: float,
        device: float,
        compiled: float,
        busy_until: float = 0.0,
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
            busy_until: when the devices finished the previous interval, if
                after its checkpoint was handed out: the caller's code ran
                beside them until then, and that time counts as the devices'.
        """
        overlapped = max(min(busy_until, started) - self._handed_out, 0.0)
        interval = {
            "compile": compiled,
            "data": data,
            "device": max(device - compiled, 0.0) + overlapped,
            "caller": started - self._handed_out - overlapped,
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
