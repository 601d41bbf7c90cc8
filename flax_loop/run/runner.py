r"""`Runner`: a set-up run's live state and the dispatch loop of one interval.

`TrainLoop` decides where an interval ends (the cadence, `n_steps`, the
caller's target); the runner trains up to there and returns the interval's
`Checkpoint`. Each dispatch is what the `DispatchPlan` groups and the feed
takes; the program that runs it is the one the plan names. What the step
that ended the interval returned goes to `Intervals.close`, which builds the
checkpoint; the time breakdown is added to it here.

Set-up (`flax_loop.run.assemble`) builds the runner; nothing below calls back
into the loop.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from flax_loop import distributed
from flax_loop.checkpoint import Checkpoint, SavedState
from flax_loop.data.feed import BatchFeed, DispatchPlan
from flax_loop.errors import DataExhaustedError, StateLostError, StoppedError
from flax_loop.log import log
from flax_loop.parallel import InFlight, Placement
from flax_loop.programs.compiled import CompiledSteps
from flax_loop.run import memory
from flax_loop.run.hand import changed_state
from flax_loop.run.interval import Intervals
from flax_loop.run.preemption import (
    PreemptionGuard,
    note_process_stop,
    process_stop,
    quiet_interrupt,
    refused_after_stop,
    resume_hint,
)
from flax_loop.run.profiling import ProfileSteps
from flax_loop.run.progress import ProgressReport
from flax_loop.run.throughput import TimeBreakdown, done_line

INTERRUPTED = (
    "interrupted at step {step:,}: the steps since the last checkpoint written are in "
    "no file. {resume} In a notebook, this loop goes on (loop.next_checkpoint())."
)
r"""The closing line of a second Ctrl-C (printed instead of a traceback)."""

STOPPED = "at step {step:,} ({why}), after its checkpoint. {resume}"
r"""The closing line of a run stopped by a signal."""


class Runner:
    r"""Trains a set-up run interval by interval.

    Args:
        state: the state the first step takes, on the devices.
        step: the number of completed steps.
        train_key: what the steps take beside the state: the run's key on
            the devices (with the frozen models, `StepInputs`).
        steps: the compiled variants.
        feed, plan: the batches; the dispatches of an interval.
        intervals: the interval closer.
        placement, guard: the devices; the signals that ask for a stop.
        times: where the time went.
        stdout: whether to print notes.
        report, profile: the progress bar, if shown; the window of steps traced, if any.
        n_steps: the total number of steps the run trains to.
    """

    def __init__(
        self,
        state: Any,
        step: int,
        train_key: Any,
        steps: CompiledSteps,
        feed: BatchFeed,
        plan: DispatchPlan,
        intervals: Intervals,
        placement: Placement,
        guard: PreemptionGuard,
        times: TimeBreakdown,
        stdout: bool,
        report: ProgressReport | None,
        profile: ProfileSteps | None,
        n_steps: int = 0,
    ) -> None:
        self.state = state
        self.step = step
        self.train_key = train_key
        self.steps = steps
        self.feed = feed
        self.plan = plan
        self.intervals = intervals
        self.placement = placement
        self.guard = guard
        self.times = times
        self.stdout = stdout
        self.report = report
        self.profile = profile
        self.lost: str | None = None  # why the run cannot go on (an interrupt)
        self.stopped_by = ""  # what asked for the last stop (Ctrl-C, SIGTERM)
        self.newest: Checkpoint | None = None
        r"""the newest checkpoint made, which the caller's body may hold."""
        self.first_step = step
        r"""the step this process started from (set-up's)."""
        self.n_steps = n_steps
        r"""the total number of steps the run trains to (`TrainLoop.n_steps`)."""

    def follow(self, every: int) -> None:
        r"""Plans the next intervals with `every` steps (a changed cadence)."""
        self.plan = DispatchPlan(every, self.plan.steps_per_dispatch)
        self.steps.follow(self.plan)

    def memory_plan(self) -> dict[str, Any]:
        r"""The bytes each device holds while training (`flax_loop.run.memory.plan`)."""
        per_dispatch = self.plan.steps_per_dispatch
        return memory.plan_of(self.steps, self.feed, per_dispatch, self.placement)

    def update_state(self, fn: Callable[[SavedState], Any]) -> None:
        r"""The state the next step takes: `fn` of the saved record now
        (`TrainLoop.update_state`)."""
        if self.lost is not None:
            raise StateLostError(self.lost)
        self.state = changed_state(self.steps, self.state, self.step, fn)
        newest = self.newest  # the checkpoint the body holds: a file written after has it
        if newest is not None and newest.step == self.step:
            newest.take_arrays(self.steps.copier()(self.state))

    def run(self, target: int | None) -> Iterator[Checkpoint]:
        r"""Yields the checkpoints up to step `target` (`None`: up to
        `n_steps`, read again after each checkpoint)."""
        if refused_after_stop(self.stdout):
            return
        with call_scope(self, self.n_steps if target is None else target):
            stop = self.n_steps if target is None else target
            if self.step >= stop:
                log(
                    f"Nothing to train: the loop is at step {self.step:,} and trains to "
                    f"step {stop:,} (n_steps is the total, counted from step 0).",
                    stdout=self.stdout,
                )
            # the body may run while the devices finish the interval (run/arrival.py)
            report = self.report  # a bar shows the numbers once in, printed lines in order
            later = (report is None or report.live) and not self.placement.multiprocess
            while self.step < (self.n_steps if target is None else target):
                stop = self.n_steps if target is None else target
                checkpoint = self.interval(self.boundary(stop), total=stop, later=later)
                if checkpoint is None:
                    log(
                        f"The data stream ended at step {self.step:,} of {stop:,}: training "
                        "stops there. Give task.data a re-iterable source (a list, a "
                        "DataLoader, a grain dataset) to read it epoch after epoch.",
                        stdout=self.stdout,
                    )
                    return
                yield checkpoint
                if _stops_after(self, checkpoint):
                    return
            self.intervals.settle()
            trained = self.step - self.first_step
            if target is None and self.step >= self.n_steps and trained:  # the closing line
                _stop(self.report)
                log(
                    done_line(trained, self.step, self.times.totals()),
                    self.stdout,
                    lead="Done:",
                    style="bold",
                )

    def stopped(self, guard: PreemptionGuard) -> None:
        r"""The run stops for the guard's request, and so does the process's training."""
        self.stopped_by = guard.name or "another process was asked to stop"
        note_process_stop(guard.signal, f"{self.stopped_by} at step {self.step:,}")

    def current(self) -> Checkpoint:
        r"""The checkpoint of the state now (the newest, or one of no steps)."""
        if self.lost is not None:
            raise StateLostError(self.lost)
        if self.newest is None or self.newest.step != self.step:
            closed = self.intervals.close(self.state, self.step, None, None, time.perf_counter())
            self.state, self.newest = closed
        return self.newest

    def run_alone(self, boundary: int) -> Checkpoint:
        r"""Runs to `boundary` and returns its checkpoint (a `DataExhaustedError`
        if the stream has no batch left; a `StoppedError` after a stop by
        signal ended the process's training)."""
        if refused_after_stop(self.stdout):
            raise StoppedError(
                f"This process was asked to stop ({process_stop()}): no loop trains "
                "after it. Call flax_loop.clear_stop() first to train anyway."
            )
        with call_scope(self, boundary):
            checkpoint = self.interval(boundary, total=boundary)
        if checkpoint is None:
            raise DataExhaustedError(
                f"The data stream has no batch left after step {self.step:,}; "
                "give the task a longer or re-iterable source."
            )
        return checkpoint

    def boundary(self, target: int | None) -> int:
        r"""Where the interval from this step ends: the next multiple of the
        cadence, or `target` if it comes first."""
        every = self.plan.every
        boundary = (self.step // every + 1) * every
        return boundary if target is None else min(boundary, target)

    def interval(self, boundary: int, total: int, later: bool = False) -> Checkpoint | None:
        r"""Runs steps up to `boundary` (of a run to `total`): its checkpoint,
        or `None` if the stream had no batch left. A stop request, even one
        made before the interval started, ends it after the step in flight.
        With `later`, the checkpoint comes before its statistics arrive
        (`Intervals.close`)."""
        guard = self.guard
        # A second Ctrl-C is raised between steps, never inside one (preemption.py).
        guard.defer = not self.placement.multiprocess
        try:
            return self._train(boundary, total, later)
        finally:
            guard.defer = False

    def _train(self, boundary: int, total: int, later: bool) -> Checkpoint | None:
        report = self.report
        if report is not None and not report.active:
            report.start(self.step, total)
        started = time.perf_counter()
        self.intervals.settle()  # the last interval's numbers (its NonFiniteError): device time
        busy_until = self.intervals.arrived
        mark = time.perf_counter()
        compiled_before = self.steps.compile_seconds
        data, device = 0.0, mark - started  # seconds waiting for batches, dispatching
        # The per-step path reads locals only: each attribute lookup or call
        # here is a measurable part of a small model's step.
        programs, take, group = self.steps.programs, self.feed.take, self.plan.group
        perf_counter = time.perf_counter
        key, guard, intervals, profile = self.train_key, self.guard, self.intervals, self.profile
        # every step's loss, read at the checkpoint
        note_loss, note_losses = intervals.losses.append, intervals.losses.extend
        queue = InFlight(self.placement.dispatch_depth)
        # Several processes must stop at the same step: they agree on it at
        # the checkpoint, never between steps.
        may_stop = not self.placement.multiprocess
        loss: Any = None
        ending = None  # what the step that ends the interval returns
        step = self.step
        while step < boundary:
            remaining = boundary - step
            dispatch = take(group(remaining), remaining, may_stop and guard.requested, step + 1)
            taken = perf_counter()
            data += taken - mark
            if dispatch is None:
                break
            batch, n_steps, variant, last = dispatch
            traced = profile is not None and profile.wants(step + 1, step + n_steps)
            if traced:
                profile.begin()  # type: ignore[union-attr]
                annotation = profile.annotate(step + 1)  # type: ignore[union-attr]
                annotation.__enter__()
            try:
                result = programs[variant](self.state, batch, key)
            except KeyboardInterrupt:  # raised before it ran: waiting for its compilation
                self.feed.untake()
                raise
            self.state, loss = result[0], result[1]
            if traced:
                annotation.__exit__(None, None, None)
                profile.record(step + 1, step + n_steps, loss, self.stdout)  # type: ignore[union-attr]
            self.step = step = step + n_steps
            if n_steps > 1:
                note_losses(loss)
            else:
                note_loss(loss)
            queue.push(loss)
            if report is not None:
                report.advance(step, loss)
            mark = perf_counter()
            device += mark - taken
            if last:
                ending = result
                break
        if guard.interrupted:  # a second Ctrl-C: the state is whole here
            raise KeyboardInterrupt
        # whether any process was asked to stop (processes agree on it)
        preempted = (
            any(distributed.gather(int(guard.requested))) if not may_stop else guard.requested
        )
        if step == intervals.start and not preempted:
            return None
        shown = None if report is None else functools.partial(_show, report, step)
        self.state, checkpoint = intervals.close(
            self.state, step, loss, ending, started, preempted, later, shown
        )
        self.newest = checkpoint
        # the checkpoint's copy and statistics: waiting for the devices
        _account(self, checkpoint, (started, mark, busy_until), data, device, compiled_before)
        if preempted:
            self.stopped(guard)
            _keep_a_ctrl_c(guard)
        return checkpoint


@contextlib.contextmanager
def call_scope(runner: Runner, last_step: int) -> Iterator[None]:
    r"""A call's scope, while `runner` trains up to `last_step`: signals become
    stop requests, failures reach the other processes, and the progress
    report shows; an interrupt that destroyed the state is remembered."""
    if runner.lost is not None:
        raise StateLostError(runner.lost)
    runner.guard.install()
    try:
        # a reading thread reads meanwhile, never past the last step trained
        runner.feed.resume(runner.step + 1, max(last_step, runner.n_steps))
        # one process has no other to fail with (nor to cross into for it)
        together = distributed.failing_together() if runner.placement.multiprocess else None
        with together or contextlib.nullcontext():
            yield
    except KeyboardInterrupt as error:
        runner.guard.clear()  # the interrupt ends this call; the next one trains on
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(runner.state)):
            runner.lost = (
                f"An interrupt at step {runner.step:,} came while the loop's state was "
                "handed from one step to the next, and that state is gone: this "
                "loop cannot go on. Make a new TrainLoop that resumes from the last "
                "checkpoint written (init=CheckpointFileReader(dir=...))."
            )
        interrupted = INTERRUPTED.format(step=runner.step, resume=resume_hint())
        quiet_interrupt(error, runner.lost or interrupted)
        raise
    finally:
        runner.feed.pause()  # no thread reads on after a call (nor is waited for)
        runner.guard.uninstall()
        runner.guard.clear()  # a request ends the call it was made in
        if runner.profile is not None:
            runner.profile.finish(runner.stdout)  # never leave a trace running
        _stop(runner.report)


def _stops_after(runner: Runner, checkpoint: Checkpoint) -> bool:
    r"""Whether the run stops after the body of `checkpoint`, saying so: a
    stop asked for in the body (one process: several agree on one at the
    next checkpoint), or one the checkpoint was made for."""
    asked = runner.guard.requested and not runner.placement.multiprocess
    if not (asked or checkpoint.preempted):
        return False
    runner.intervals.settle()  # its NonFiniteError before the closing line
    if asked:
        runner.stopped(runner.guard)
    _stop(runner.report)  # the bar's last line before the closing one
    message = STOPPED.format(step=runner.step, why=runner.stopped_by, resume=resume_hint())
    log(message, runner.stdout, lead="Stopped:", style="bold yellow")
    return True


def _stop(report: ProgressReport | None) -> None:
    r"""The progress bar stops (its last line stays above what comes next)."""
    if report is not None:
        report.stop()


def _keep_a_ctrl_c(guard: PreemptionGuard) -> None:
    r"""At the stop's checkpoint: a Ctrl-C request stays until the call ends
    (a second Ctrl-C in the body of this last checkpoint is a second press,
    raised at once); another signal's is cleared: a new request there, which
    the stop already honours (a second SIGTERM must not end the body writing
    the file)."""
    if guard.signal != signal.SIGINT:
        guard.clear()


def _show(report: ProgressReport, step: int, checkpoint: Checkpoint) -> None:
    r"""The checkpoint's loss and metrics in the progress report."""
    metrics = {k: v for k, v in checkpoint.train_metrics.items() if k != "loss"}
    loss = checkpoint.mean_loss if checkpoint.n_completed_steps else checkpoint.loss
    report.checkpoint(step, loss, metrics)


def _account(
    runner: Runner,
    checkpoint: Checkpoint,
    clocks: tuple[float, float, float],
    data: float,
    device: float,
    compiled_before: float,
) -> None:
    r"""Where the checkpoint's interval's time went (`clocks`: the interval's
    start, the end of its last dispatch (the close since counts as device
    time), and when the devices finished the previous interval); its rates
    come with its statistics (`Intervals.close`)."""
    started, mark, busy_until = clocks
    ended = time.perf_counter()
    compiled = runner.steps.compile_seconds - compiled_before  # in dispatches or the close
    checkpoint.time_breakdown = runner.times.close(
        started, ended, data, device + ended - mark, compiled, busy_until
    )
