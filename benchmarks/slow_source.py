"""A data source that waits as long as a step computes: how much of the ideal rate each loop keeps.

    python benchmarks/slow_source.py [--rounds 5] [--steps 300]

The source sleeps D before each batch (I/O: the wait releases the GIL), D
being one step's compute time, measured first. The ideal rate is then
min(compute rate, source rate): reading and computing fully overlapped; the
source rate is measured by reading it alone in each round (a sleep of D
takes a little longer than D, so it is a little below 1/D). A
serial loop reaches 1/(2D), 0.5 of it. Rounds alternate: the hand-written
loop on batches in memory (the compute rate), the hand-written loop on the
slow source (JAX's asynchronous dispatch overlaps one read with the step in
flight), a TrainLoop reading inline (`prefetch=0`) and a TrainLoop with its
default (a background thread reads ahead once the first reads prove slow).
Each figure is the median over rounds of the per-round ratio to the ideal.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import itertools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from harness import make_batches, timed_loop  # noqa: E402
from loop_overhead import MLP, hand_written  # noqa: E402

from flax_loop import TrainLoop, TrainTask  # noqa: E402
from flax_loop.parallel import Placement  # noqa: E402


class SlowSource:
    """Endless batches, each after waiting `delay` seconds."""

    def __init__(self, batches, delay):
        self.batches, self.delay = itertools.cycle(batches), delay

    def __iter__(self):
        return self

    def __next__(self):
        time.sleep(self.delay)
        return next(self.batches)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", default=os.path.join("benchmarks", "results", "slow_source.json"))
    args = parser.parse_args()
    model, optimizer = MLP((512, 512, 10)), optax.adam(1e-3)
    batches = make_batches((784,), 128)
    depth = Placement(jax.devices()[:1]).dispatch_depth
    in_memory = hand_written(model, optimizer, batches, 1, [], depth)
    in_memory(50)
    delay = in_memory(args.steps) / args.steps  # D: one step's compute
    slow_hand = hand_written(
        model, optimizer, batches, 1, [], depth, source=SlowSource(batches, delay)
    )

    def managed(prefetch):
        loop = TrainLoop(
            init=model.init,
            task=TrainTask(
                model.apply,
                optimizer,
                lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
                    logits, labels
                ).mean(),
                SlowSource(batches, delay),
            ),
            rnkey=jax.random.key(0),
            devices=jax.devices()[:1],
            n_steps_per_checkpoint=10**9,
            stdout=False,
            **({} if prefetch is None else {"prefetch": prefetch}),
        )
        return timed_loop(loop)

    source_alone = SlowSource(batches, delay)

    def read_alone(n_steps):
        started = time.perf_counter()
        for _ in range(n_steps):
            next(source_alone)
        return time.perf_counter() - started

    runs = {
        "the source alone (no training)": read_alone,
        "hand-written, batches in memory": in_memory,
        "hand-written, slow source": slow_hand,
        "TrainLoop prefetch=0": managed(0),
        "TrainLoop default (prefetch)": managed(None),
    }
    for run in runs.values():
        run(20)  # warm up (the default loop decides to prefetch here)
    ratios = {name: [] for name in runs}
    rates = {name: [] for name in runs}
    for _ in range(args.rounds):
        seconds = {name: run(args.steps) for name, run in runs.items()}
        compute_rate = args.steps / seconds["hand-written, batches in memory"]
        ideal = min(compute_rate, args.steps / seconds["the source alone (no training)"])
        for name, elapsed in seconds.items():
            rates[name].append(args.steps / elapsed)
            ratios[name].append(args.steps / elapsed / ideal)
    print(
        f"JAX {jax.__version__}, {os.cpu_count()} cores, 1 device; MLP 784-512-512-10, "
        f"batch 128, Adam; D = {delay * 1e3:.2f} ms; medians of {args.rounds} rounds"
    )
    print(f"{'loop':<34}{'steps/s':>9}{'of ideal':>10}")
    results = {}
    for name in runs:
        rate, ratio = statistics.median(rates[name]), statistics.median(ratios[name])
        results[name] = {"steps_per_second": rate, "of_ideal": ratio}
        print(f"{name:<34}{rate:>9.1f}{ratio:>10.2f}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as out:
        json.dump({"delay_seconds": delay, "results": results}, out, indent=2)


if __name__ == "__main__":
    main()
