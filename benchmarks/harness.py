"""What the benchmark scripts share: synthetic batches and timing a TrainLoop."""

import time

import numpy as np


def make_batches(shape, batch, count=16, seed=0):
    """`count` batches of normal inputs of `shape` and labels in 0..9."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(batch, *shape)).astype(np.float32),
            rng.integers(0, 10, batch).astype(np.int32),
        )
        for _ in range(count)
    ]


def timed_loop(loop):
    """run(n_steps) -> seconds for a TrainLoop (one checkpoint per run, at its end)."""

    def run(n_steps):
        started = time.perf_counter()
        for _ in loop.run(loop.step + n_steps):
            pass
        return time.perf_counter() - started

    return run
