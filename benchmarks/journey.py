"""How far a batch travels: the flax_loop modules and Python calls of two journeys.

1. One steady interval (after the first, so nothing compiles) and the write
   of its checkpoint file: from `next(iterator)` to the file on disk, and
   the same from `loop.next_checkpoint()` (a notebook's call).
2. One resume: a `TrainLoop` built from a directory's newest file, up to
   its first checkpoint.

Each journey is recorded with `sys.setprofile` (Python calls only; the
devices' work is not counted): the flax_loop modules whose functions run,
the number of those calls, and the switches from one module to another.
The figures describe the code's shape, not its speed: ARCHITECTURE.md
quotes them.

    python benchmarks/journey.py
"""

import os
import sys
import tempfile
import threading
from collections import Counter

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from harness import cross_entropy  # noqa: E402

from flax_loop import CheckpointFileReader, CheckpointFileWriter, TrainLoop, TrainTask  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


def batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 64)).astype(np.float32)
    y = rng.integers(0, 10, 512).astype(np.int32)
    return [(x[i : i + 32], y[i : i + 32]) for i in range(0, 512, 32)]


class Journey:
    """Records the flax_loop functions called on this thread while active."""

    def __init__(self):
        self.modules = Counter()
        self.calls = 0
        self.switches = 0
        self._last = None

    def __enter__(self):
        self._thread = threading.get_ident()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def _profile(self, frame, event, arg):
        if event != "call" or threading.get_ident() != self._thread:
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("flax_loop"):
            return
        self.calls += 1
        self.modules[module] += 1
        if module != self._last:
            self.switches += 1 if self._last is not None else 0
            self._last = module

    def report(self, title):
        print(f"{title}: {len(self.modules)} modules, {self.calls} calls, {self.switches} switches")
        for module, count in self.modules.most_common():
            print(f"  {count:5d}  {module}")


def main():
    model = MLP()
    directory = tempfile.mkdtemp(prefix="flax_loop-journey-")

    def loop(init):
        return TrainLoop(
            init=init,
            task=TrainTask(model.apply, optax.adam(1e-3), cross_entropy, batches()),
            rnkey=jax.random.key(0),
            n_steps=30,
            n_steps_per_checkpoint=10,
            stdout=False,
        )

    writer = CheckpointFileWriter(output_dir=directory)
    iterator = iter(loop(model.init))
    writer(next(iterator))  # the first interval compiles and writes once
    with Journey() as steady:
        checkpoint = next(iterator)
        writer(checkpoint)
    steady.report("One steady interval and its file write (for checkpoint in loop)")
    notebook = loop(model.init)
    notebook_writer = CheckpointFileWriter(output_dir=tempfile.mkdtemp(prefix="flax_loop-journey-"))
    notebook_writer(notebook.next_checkpoint())  # the first interval compiles
    with Journey() as by_call:
        notebook_writer(notebook.next_checkpoint())
    by_call.report("One steady interval and its file write (loop.next_checkpoint())")
    with Journey() as resume:
        resumed = loop(CheckpointFileReader(dir=directory, target=model.init))
        next(iter(resumed))
    resume.report("One resume, to its first checkpoint")


if __name__ == "__main__":
    main()
