"""Sharded state on 4 devices: TrainLoop "fsdp" against "replicated" and a hand-written FSDP step.

    python benchmarks/sharding.py [--quick] [--json results/sharding.json]

- hand-written FSDP: `jax.jit` of a plain step (mean loss over the global
  batch, Adam) with the same in/out shardings as the loop's "fsdp" state:
  every leaf of at least 1 MiB split along its largest dimension 4 divides,
  the batch split along "data"; XLA places the collectives.
- TrainLoop(sharding="fsdp") and TrainLoop(sharding="replicated").

Rounds alternate the variants; the ratio is the median of per-round ratios.
Then the bytes of parameters + optimizer state on device 0 for each layout,
and the seconds to write one checkpoint of the fsdp state with the file
writer and with the Orbax writer (each waited for).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

N_DEVICES = 4
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N_DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import itertools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from harness import make_batches, timed_loop  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from flax_loop import (  # noqa: E402
    CheckpointFileWriter,
    OrbaxCheckpointWriter,
    TrainLoop,
    TrainTask,
)
from flax_loop.parallel import Placement  # noqa: E402
from flax_loop.programs.sharding import DEFAULT_FSDP_MIN_BYTES, fsdp_spec  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(2048)(x))
        x = nn.relu(nn.Dense(2048)(x))
        return nn.Dense(10)(x)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def hand_written_fsdp(model, optimizer, data):
    """run(n_steps) -> seconds of a plain jit FSDP loop, dispatch depth 2."""
    placement = Placement(jax.devices())
    mesh = placement.mesh

    def layout(leaf):
        spec = fsdp_spec(leaf.shape, leaf.dtype.itemsize, N_DEVICES, DEFAULT_FSDP_MIN_BYTES)
        return NamedSharding(mesh, spec)

    params = jax.jit(model.init)(jax.random.key(0), data[0][0])["params"]
    opt_state = optimizer.init(params)
    shardings = jax.tree.map(layout, (params, opt_state))
    state = jax.device_put((params, opt_state), shardings)
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())

    def step(state, x, y):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(model.apply({"params": p}, x), y))(
            params
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    compiled = jax.jit(
        step,
        in_shardings=(shardings, batch_sharding, batch_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=0,
    )
    batches = itertools.cycle(data)
    holder = {"state": state}

    def run(n_steps):
        started = time.perf_counter()
        state, queue = holder["state"], deque()
        for _ in range(n_steps):
            x, y = next(batches)
            state, loss = compiled(state, x, y)
            queue.append(loss)
            if len(queue) > 2:
                queue.popleft().block_until_ready()
        jax.block_until_ready(state)
        holder["state"] = state
        return time.perf_counter() - started

    return run


def loop_runner(model, optimizer, data, sharding):
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optimizer, cross_entropy, itertools.cycle(data)),
        rnkey=jax.random.key(0),
        n_steps_per_checkpoint=10**9,
        stdout=False,
        preemption_signals=(),
        sharding=sharding,
    )
    return loop, timed_loop(loop)


def device_zero_bytes(checkpoint):
    leaves = jax.tree.leaves((checkpoint.model_params, checkpoint.optimizer_state))
    zero = jax.devices()[0]
    on_zero = sum(
        shard.data.nbytes
        for leaf in leaves
        for shard in leaf.addressable_shards
        if shard.device == zero
    )
    return on_zero, sum(leaf.nbytes for leaf in leaves)


def write_seconds(writer_type, checkpoint, rounds):
    times = []
    for _ in range(rounds):
        directory = tempfile.mkdtemp(prefix="flax_loop-bench-")
        writer = writer_type(output_dir=directory)
        started = time.perf_counter()
        writer(checkpoint)
        writer.close()  # waits for the write
        times.append(time.perf_counter() - started)
        shutil.rmtree(directory)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    # Each round ends with a checkpoint (a copy of the state); 60 steps a round
    # keep that under 1% of the round, as one every few hundred steps would be.
    rounds, steps = (3, 5) if args.quick else (7, 60)
    model, optimizer = MLP(), optax.adam(1e-3)
    data = make_batches((784,), 128)

    runners = {"hand-written fsdp": hand_written_fsdp(model, optimizer, data)}
    loops = {}
    for sharding in ("fsdp", "replicated"):
        loops[sharding], runners[f"TrainLoop {sharding}"] = loop_runner(
            model, optimizer, data, sharding
        )
    for run in runners.values():  # warm up: compile, first dispatches
        run(3)
    seconds = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            seconds[name].append(run(steps))
    base = seconds["hand-written fsdp"]

    def steps_per_second(name):
        return steps / statistics.median(seconds[name])

    def ratio(name):  # > 1: faster than the hand-written step
        return statistics.median(b / s for b, s in zip(base, seconds[name]))

    print(f"JAX {jax.__version__}, {N_DEVICES} forced CPU devices, MLP 784-2048-2048-10, Adam,")
    print(f"batch 128; medians of {rounds} rounds of {steps} steps")
    print(f"{'variant':22} {'steps/s':>8} {'vs hand-written fsdp':>21}")
    results = {"rounds": rounds, "steps": steps, "variants": {}}
    for name in runners:
        print(f"{name:22} {steps_per_second(name):8.2f} {ratio(name):21.2f}")
        results["variants"][name] = {
            "steps_per_second": steps_per_second(name),
            "ratio": ratio(name),
        }

    memory = {}
    for sharding, loop in loops.items():
        checkpoint = loop.next_step()
        memory[sharding] = device_zero_bytes(checkpoint)
    for sharding, (on_zero, total) in memory.items():
        print(
            f"state on device 0, {sharding:10}: {on_zero / 2**20:7.1f} MiB of "
            f"{total / 2**20:.1f} MiB ({on_zero / total:.0%})"
        )
    results["device_zero_bytes"] = memory

    checkpoint = loops["fsdp"].next_step()
    writes = {
        name: write_seconds(writer, checkpoint, 3)
        for name, writer in (("file", CheckpointFileWriter), ("orbax", OrbaxCheckpointWriter))
    }
    print(
        f"one checkpoint of the fsdp state, written and waited for: file writer "
        f"{writes['file']:.2f} s, Orbax writer {writes['orbax']:.2f} s"
    )
    results["write_seconds"] = writes
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(results, stream, indent=2)


if __name__ == "__main__":
    main()
