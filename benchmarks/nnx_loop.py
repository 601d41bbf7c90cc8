"""TrainLoop on NNX modules against two hand-written NNX loops, one process.

    python benchmarks/nnx_loop.py [--quick] [--json results/nnx_loop.json]

Baselines, both hand-written the way Flax's documentation shows:

- functional: `nnx.split` once, a `jax.jit` step that `nnx.merge`s inside and
  returns the new states (`jax.shard_map` with `pmean` on several devices);
- nnx.jit: the MNIST tutorial's loop, `nnx.Optimizer` and an `nnx.jit` step
  that walks the module's object graph at every call (one device: the
  tutorial's loop has no data parallelism).

Rounds alternate the variants; the ratio is the median of per-round ratios
(TrainLoop / baseline; 1.00 means as fast). Adam, numpy batches, the same
model and data for all.
"""

import argparse
import json
import os
import sys

N_DEVICES = 4
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N_DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import itertools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from harness import make_batches, timed_loop  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from flax_loop import TrainLoop, TrainTask  # noqa: E402
from flax_loop.parallel import Placement  # noqa: E402


class CNN(nnx.Module):
    """Flax's MNIST tutorial CNN (28x28 inputs), BatchNorm and Dropout included."""

    def __init__(self, *, rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(32, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(64, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.linear1 = nnx.Linear(7 * 7 * 64, 128, rngs=rngs)
        self.linear2 = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.bn1(self.conv1(x))), (2, 2), (2, 2))
        x = nnx.max_pool(nnx.relu(self.bn2(self.conv2(x))), (2, 2), (2, 2))
        x = self.dropout(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))
        return self.linear2(x)


class MLP(nnx.Module):
    def __init__(self, *, rngs):
        self.linear1 = nnx.Linear(784, 512, rngs=rngs)
        self.linear2 = nnx.Linear(512, 512, rngs=rngs)
        self.linear3 = nnx.Linear(512, 10, rngs=rngs)

    def __call__(self, x):
        return self.linear3(nnx.relu(self.linear2(nnx.relu(self.linear1(x)))))


WORKLOADS = {
    "nnx-mlp-784-512-512-10": dict(model=MLP, shape=(784,), batch=128, steps=400),
    "nnx-cnn-bn-dropout": dict(model=CNN, shape=(28, 28, 1), batch=64, steps=40),
}


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def timed(step_fn, batches, depth):
    """run(n_steps) -> seconds for a `step_fn(x, y) -> loss`, dispatch bounded."""

    def run(n_steps):
        stream = itertools.cycle(batches)
        in_flight = deque()
        started = time.perf_counter()
        for _ in range(n_steps):
            loss = step_fn(*next(stream))
            in_flight.append(loss)
            if len(in_flight) > depth:
                in_flight.popleft().block_until_ready()
        loss.block_until_ready()
        return time.perf_counter() - started

    return run


def functional(make_model, batches, n_devices, depth):
    """nnx.split once; a jitted step that merges inside and returns the states."""
    model = make_model(rngs=nnx.Rngs(0))
    optimizer = optax.adam(1e-3)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = (params, rest, optimizer.init(params))

    def update(state, x, y):
        params, rest, opt_state = state

        def loss_fn(params):
            # copies of the variables at this trace level, so BatchNorm can update them
            module = nnx.merge(graphdef, params, jax.tree.map(lambda v: v, rest))
            if n_devices > 1:  # each device its own dropout masks
                device = jax.lax.axis_index("data")
                nnx.reseed(module, default=jax.random.fold_in(jax.random.key(0), device))
            loss = cross_entropy(module(x), y)
            return loss, nnx.state(module, nnx.Not(nnx.Param))

        (loss, new_rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        if n_devices > 1:
            loss, grads = jax.lax.pmean((loss, grads), "data")
            new_rest = jax.tree.map(
                lambda v: jax.lax.pmean(v, "data") if jnp.issubdtype(v.dtype, jnp.inexact) else v,
                new_rest,
            )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_rest, opt_state), loss

    if n_devices > 1:
        mesh = Mesh(np.array(jax.devices()[:n_devices]), ("data",))
        state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
        update = jax.shard_map(
            update,
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec("data"), PartitionSpec("data")),
            out_specs=(PartitionSpec(), PartitionSpec()),
            check_vma=False,
        )
    step = jax.jit(update, donate_argnums=0)
    holder = {"state": state}

    def step_fn(x, y):
        holder["state"], loss = step(holder["state"], x, y)
        return loss

    step_fn(*batches[0]).block_until_ready()  # compile
    return timed(step_fn, batches, depth)


def tutorial(make_model, batches, depth):
    """The MNIST tutorial's loop: nnx.Optimizer and an nnx.jit step."""
    model = make_model(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(model):
            return cross_entropy(model(x), y)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def step_fn(x, y):
        return step(model, optimizer, x, y)

    step_fn(*batches[0]).block_until_ready()  # compile
    return timed(step_fn, batches, depth)


def managed(make_model, batches, n_devices):
    model = make_model(rngs=nnx.Rngs(0))
    loop = TrainLoop(
        init=model,
        task=TrainTask(model, optax.adam(1e-3), cross_entropy, itertools.cycle(batches)),
        rnkey=jax.random.key(0),
        devices=jax.devices()[:n_devices],
        n_steps_per_checkpoint=10**9,  # one checkpoint per run: at its end
        stdout=False,
    )

    return timed_loop(loop)


def measure(runs, n_steps, repeats):
    for run in runs.values():
        run(max(n_steps // 10, 2))  # warm up
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(run(n_steps))
    rates = {name: n_steps / statistics.median(values) for name, values in times.items()}
    managed_times = times["TrainLoop"]
    ratios = {
        name: statistics.median(b / t for b, t in zip(values, managed_times))
        for name, values in times.items()
        if name != "TrainLoop"
    }
    return rates, ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, one repeat")
    parser.add_argument("--json", default=os.path.join("benchmarks", "results", "nnx_loop.json"))
    parser.add_argument("--only", default=None, help="run one workload")
    parser.add_argument("--devices", type=int, default=None, help="run one device count")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    print(
        f"JAX {jax.__version__}, flax {__import__('flax').__version__}, {os.cpu_count()} cores, "
        f"{N_DEVICES} forced CPU devices; medians of {repeats} rounds; "
        "ratio = TrainLoop / baseline, median of per-round ratios"
    )
    print(
        f"{'workload':<24}{'devices':>8}{'baseline':>12}{'steps/s':>10}{'TrainLoop':>11}{'ratio':>7}"
    )
    rows = []
    for name, spec in WORKLOADS.items():
        if args.only and name != args.only:
            continue
        batches = make_batches(spec["shape"], spec["batch"])
        n_steps = spec["steps"] // (5 if args.quick else 1)
        for n_devices in (1, 4) if args.devices is None else (args.devices,):
            depth = Placement(jax.devices()[:n_devices]).dispatch_depth
            runs = {
                "TrainLoop": managed(spec["model"], batches, n_devices),
                "functional": functional(spec["model"], batches, n_devices, depth),
            }
            if n_devices == 1:
                runs["nnx.jit"] = tutorial(spec["model"], batches, depth)
            rates, ratios = measure(runs, n_steps, repeats)
            for baseline, ratio in ratios.items():
                row = dict(
                    workload=name,
                    devices=n_devices,
                    baseline=baseline,
                    baseline_steps_per_second=rates[baseline],
                    steps_per_second=rates["TrainLoop"],
                    ratio=ratio,
                )
                rows.append(row)
                print(
                    f"{name:<24}{n_devices:>8}{baseline:>12}{rates[baseline]:>10,.1f}"
                    f"{rates['TrainLoop']:>11,.1f}{ratio:>7.2f}"
                )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"jax": jax.__version__, "repeats": repeats, "rows": rows}, handle, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
