"""A re-run in one process: a notebook cell that builds and runs a TrainLoop
again, against a hand-written loop whose jitted step is defined once.

    python benchmarks/rerun.py [--rounds 5] [--steps 200]

The model, the loss, the optimizer and the data are made once, as a
notebook's earlier cells make them; each re-run builds a new TrainLoop of
them and trains `--steps` steps (one checkpoint), or re-initializes the
hand-written loop's parameters and trains as many. The first run of each
(compilation included) is reported apart; the ratio is the median of the
re-runs' per-round ratios of seconds (TrainLoop / hand-written; the target
is <= 1.2).

A cell run again with its model, optimizer and loss built anew (new
objects: the in-process cache, keyed by identity, misses) is measured too:
its compile seconds (`loop.time_breakdown["compile"]`) against the first
run's, JAX's persistent compilation cache in a fresh folder of its own
(the default a TrainLoop turns on), so that the first run starts cold.
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections import deque

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # cold at the first run
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="rerun-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from flax_loop import TrainLoop, TrainTask  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (256, 256):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default="benchmarks/results/rerun.json")
    arguments = parser.parse_args()
    rng = np.random.default_rng(0)
    data = [
        (rng.normal(size=(32, 64)).astype(np.float32), rng.integers(0, 10, 32).astype(np.int32))
        for _ in range(16)
    ]
    model, optimizer, steps = MLP(), optax.adam(1e-3), arguments.steps

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(model.apply({"params": p}, x), y))(
            params
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    init = jax.jit(lambda key: model.init(key, data[0][0])["params"])

    def hand_written():
        started = time.perf_counter()
        params = init(jax.random.key(0))
        opt_state = optimizer.init(params)
        in_flight = deque()
        for index in range(steps):
            params, opt_state, loss = step(params, opt_state, *data[index % len(data)])
            in_flight.append(loss)
            if len(in_flight) > 2:
                in_flight.popleft().block_until_ready()
        loss.block_until_ready()
        return time.perf_counter() - started

    def train_loop():
        started = time.perf_counter()
        loop = TrainLoop(
            init=model.init,
            task=TrainTask(model.apply, optimizer, cross_entropy, data),
            rnkey=jax.random.key(0),
            n_steps=steps,
            n_steps_per_checkpoint=steps,
            devices=jax.devices()[:1],
            stdout=False,
        )
        for _ in loop:
            pass
        return time.perf_counter() - started

    def rebuilt_cell():
        class Rebuilt(nn.Module):  # the cell's model, class and all, defined again
            @nn.compact
            def __call__(self, x):
                for width in (256, 256):
                    x = nn.relu(nn.Dense(width)(x))
                return nn.Dense(10)(x)

        def loss(logits, labels):  # and its loss
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        fresh = Rebuilt()
        loop = TrainLoop(
            init=fresh.init,
            task=TrainTask(fresh.apply, optax.adam(1e-3), loss, data),
            rnkey=jax.random.key(0),
            n_steps=steps,
            n_steps_per_checkpoint=steps,
            devices=jax.devices()[:1],
            stdout=False,
        )
        for _ in loop:
            pass
        loop.compiled.wait()
        return loop

    cold = rebuilt_cell()  # the first run: everything compiles (the cache is cold)
    first_compile = cold.time_breakdown["compile"]
    rebuilt = [rebuilt_cell().time_breakdown["compile"] for _ in range(arguments.rounds)]
    first = {"hand_written": hand_written(), "train_loop": train_loop()}
    rounds = []
    for _ in range(arguments.rounds):
        base, ours = hand_written(), train_loop()
        rounds.append((base, ours, ours / base))
    base, ours, ratio = (statistics.median(column) for column in zip(*rounds))
    print(f"JAX {jax.__version__}, {os.cpu_count()} cores; MLP 64-256-256-10, Adam, {steps} steps")
    print(
        f"first run (compiling): hand-written {first['hand_written']:.2f} s, "
        f"TrainLoop {first['train_loop']:.2f} s"
    )
    print(
        f"re-run (median of {arguments.rounds}): hand-written {base:.3f} s, "
        f"TrainLoop {ours:.3f} s, ratio {ratio:.2f}"
    )
    again = statistics.median(rebuilt)
    print(
        f"a cell run again with its model, optimizer and loss rebuilt: compile "
        f"{again:.3f} s (median of {arguments.rounds}) against the first run's "
        f"{first_compile:.3f} s: {again / first_compile:.0%} (target <= 20%)"
    )
    os.makedirs(os.path.dirname(arguments.json), exist_ok=True)
    with open(arguments.json, "w") as stream:
        json.dump(
            {
                "first": first,
                "rerun": {"hand_written": base, "train_loop": ours, "ratio": ratio},
                "rebuilt_compile_seconds": {"first": first_compile, "again": again},
            },
            stream,
            indent=1,
        )
    print(f"wrote {arguments.json}")


if __name__ == "__main__":
    main()
