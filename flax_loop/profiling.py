r"""Tracing a window of training steps with `jax.profiler`.

>>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0), n_steps=6,
...                  stdout=False, profile=ProfileSteps(start=3, n=2, log_dir=str(tmp / "trace")))
>>> _ = list(loop)
>>> loop.profile.traced_steps
[3, 4]

The trace goes to `log_dir` (`plugins/profile/<run>/*.xplane.pb`), which
TensorBoard's profile plugin and Perfetto read.
"""

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
        r"""Starts the trace (once)."""
        if not self._active:
            jax.profiler.start_trace(self.log_dir)
            self._active = True

    def annotate(self, step: int) -> Any:
        r"""The annotation a traced dispatch runs under."""
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def record(self, first_step: int, last_step: int, marker: Any) -> None:
        r"""Notes a traced dispatch; stops the trace after the window's last step."""
        self.traced_steps.extend(range(max(first_step, self.start), min(last_step, self.end) + 1))
        if last_step >= self.end:
            jax.block_until_ready(marker)
            self.finish()

    def finish(self) -> None:
        r"""Stops the trace if it runs (the loop calls it when it stops early too)."""
        if self._active:
            jax.profiler.stop_trace()
            self._active = False
            self._done = True
            log(f"Traced steps {self.traced_steps[0]}-{self.traced_steps[-1]} into {self.log_dir}.")
