r"""Tracing a window of training steps with `jax.profiler`.

>>> import optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop import TrainLoop, TrainTask
>>> import pathlib, tempfile
>>> tmp = pathlib.Path(tempfile.mkdtemp())
>>> model = nn.Dense(3)
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
>>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
>>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0), n_steps=6,
...                  stdout=False, profile=ProfileSteps(start=3, n=2, log_dir=str(tmp / "trace")))
>>> _ = list(loop)
>>> loop.profile.traced_steps
[3, 4]

The trace goes to `log_dir` (`plugins/profile/<run>/*.xplane.pb`), which
TensorBoard's profile plugin and Perfetto read.

Profiling never costs training: a trace that cannot start (another trace
runs, `log_dir` cannot be made) or cannot be written is a note on the
console (and `ProfileSteps.problem`), and the loop trains on.
"""

import os
from dataclasses import dataclass, field
from typing import Any

import jax

from flax_loop.errors import ConfigError, check_count
from flax_loop.log import log


@dataclass
class ProfileSteps:
    r"""Traces steps `start` to `start + n - 1` (steps count from 1) into `log_dir`.

    The trace starts before the dispatch that trains step `start` and stops
    once the dispatch that trains step `start + n - 1` has finished on the
    devices, so it holds those steps whole; each is annotated with its step
    number (`jax.profiler.StepTraceAnnotation`).
    """

    start: int
    r"""the first step traced."""

    n: int = 10
    r"""how many steps to trace."""

    log_dir: str = "profile"
    r"""the directory the trace is written to."""

    traced_steps: list[int] = field(default_factory=list, init=False)
    r"""the steps dispatched while tracing (filled as the loop runs)."""

    problem: str | None = field(default=None, init=False)
    r"""why the trace could not be taken or written, if it could not."""

    def __post_init__(self) -> None:
        check_count("start", self.start, 1)
        check_count("n", self.n, 1)
        if not isinstance(self.log_dir, str) or not self.log_dir:
            raise ConfigError(f"log_dir must be a directory path; got {self.log_dir!r}.")
        self._active = False
        self._done = False

    @property
    def end(self) -> int:
        r"""the last step traced."""
        return self.start + self.n - 1

    def wants(self, first_step: int, last_step: int) -> bool:
        r"""Whether a dispatch training steps `first_step..last_step` is traced."""
        return not self._done and first_step <= self.end and last_step >= self.start

    def begin(self) -> None:
        r"""Starts the trace (once); a trace that cannot start is a note."""
        if self._active or self._done:
            return
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            jax.profiler.start_trace(self.log_dir)
        except Exception as error:  # never a lost batch: the loop trains on
            self._give_up(f"could not start ({type(error).__name__}: {error})")
            return
        self._active = True

    def annotate(self, step: int) -> Any:
        r"""The annotation a traced dispatch runs under."""
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def record(self, first_step: int, last_step: int, marker: Any, stdout: bool = True) -> None:
        r"""Notes a traced dispatch; stops the trace after the window's last step."""
        self.traced_steps.extend(range(max(first_step, self.start), min(last_step, self.end) + 1))
        if last_step >= self.end:
            jax.block_until_ready(marker)
            self.finish(stdout)

    def finish(self, stdout: bool = True) -> None:
        r"""Stops the trace if it runs (the loop calls it when it stops early
        too); a trace that cannot be written is a note. `stdout`: whether the
        closing "Traced steps ..." line is printed (the loop's); a trace that
        fails is said regardless."""
        if not self._active:
            return
        self._active = False
        self._done = True
        try:
            jax.profiler.stop_trace()
        except Exception as error:
            _forget_session()
            self._give_up(f"could not be written ({type(error).__name__}: {error})")
            return
        steps = self.traced_steps
        where = f"{steps[0]}-{steps[-1]}" if steps else f"{self.start}-{self.end}"
        log(f"Traced steps {where} into {self.log_dir}.", stdout=stdout)

    def _give_up(self, why: str) -> None:
        self._done = True
        self.problem = f"The trace of steps {self.start}-{self.end} into {self.log_dir!r} {why}."
        log(f"{self.problem} Training goes on without it.", lead="Profiling:", style="yellow")


def _forget_session() -> None:
    r"""After a failed export `jax.profiler` still holds its session, so no
    trace could start again in this process: let it go."""
    from jax._src import profiler

    state = getattr(profiler, "_profile_state", None)
    if state is not None and getattr(state, "profile_session", None) is not None:
        state.reset()
