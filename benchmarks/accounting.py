"""What the loop's own accounting costs a step: the time breakdown and throughput.

    python benchmarks/accounting.py [--rounds 5] [--steps 2000] [--json results/accounting.json]

Every dispatch the loop reads the clock twice and adds two floats (where the
time went, `flax_loop.run.throughput`); every checkpoint it adds an interval's parts
and computes its rates (`flax_loop.run.throughput`). The script times the small
MLP (64-32-10, batch 32, one device, one step a dispatch: the case where a
step is cheapest, so any per-dispatch cost weighs most) through a TrainLoop,
then times the accounting's per-dispatch statements alone, executed as the
loop executes them, in the same process, and reports their ratio. The
per-checkpoint work is timed the same way and spread over the interval's
steps (one checkpoint every 100 steps here).
"""

import argparse
import json
import os
import statistics
import sys
import time
import timeit

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import optax  # noqa: E402
from harness import MLP, cross_entropy, make_batches, timed_loop  # noqa: E402

from flax_loop import TrainLoop, TrainTask  # noqa: E402
from flax_loop.run.throughput import TimeBreakdown  # noqa: E402

EVERY = 100


def per_dispatch_seconds(number=1_000_000):
    """The accounting's statements of one dispatch, as the loop runs them."""
    setup = "from time import perf_counter\nmark = perf_counter()\ndata = device = 0.0"
    statement = "taken = perf_counter()\ndata += taken - mark\nmark = perf_counter()\ndevice += mark - taken"
    empty = timeit.timeit("pass", setup=setup, number=number)
    return (timeit.timeit(statement, setup=setup, number=number) - empty) / number


def per_checkpoint_seconds(number=100_000):
    """The interval's parts added to the run's (`TimeBreakdown.close`) and its clock reads."""
    times = TimeBreakdown(1.0, 0.5)

    def close():
        started = time.perf_counter()
        times.close(started, time.perf_counter(), data=0.1, device=0.5, compiled=0.0)

    return timeit.timeit(close, number=number) / number


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    model = MLP()
    data = make_batches((64,), 32, count=16)
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.adam(1e-3), cross_entropy, data * 10_000),
        rnkey=jax.random.key(0),
        n_steps_per_checkpoint=EVERY,
        devices=jax.devices()[:1],
        stdout=False,
    )
    run = timed_loop(loop)
    run(2 * EVERY)  # compiled, warm
    rows = []
    for _ in range(args.rounds):
        step = run(args.steps) / args.steps
        dispatch = per_dispatch_seconds()
        checkpoint = per_checkpoint_seconds() / EVERY
        rows.append(dict(step_us=step * 1e6, accounting_us=(dispatch + checkpoint) * 1e6))
        rows[-1]["fraction"] = rows[-1]["accounting_us"] / rows[-1]["step_us"]
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print(f"{'round':>5} {'step us':>9} {'accounting us':>14} {'fraction':>9}")
    for index, row in enumerate(rows):
        print(
            f"{index:>5} {row['step_us']:>9.2f} {row['accounting_us']:>14.3f} "
            f"{row['fraction']:>9.3%}"
        )
    print(
        f"median: a step {median['step_us']:.2f} us, its accounting "
        f"{median['accounting_us']:.3f} us = {median['fraction']:.3%} of it (target < 1%)"
    )
    if args.json:
        with open(args.json, "w") as stream:
            json.dump({"rounds": rows, "median": median}, stream, indent=2)


if __name__ == "__main__":
    main()
