"""Compile time: a TrainLoop's programs against a hand-written `jax.jit` of the same step.

    python benchmarks/compile_time.py [--rounds 3] [--only mlp|gan|ppo]

One process, nothing cached: JAX's persistent cache is off and the loop's
own programs are forgotten before each round (`flax_loop.programs.cache`).
Each round alternates the two. The hand-written side traces, lowers and
compiles its step (`jax.jit(step).lower(...).compile()`, what its first call
does). The TrainLoop side is built over the same task (set-up compiles the
program its first dispatch needs: "first"), then waits for every program a
run of its cadence compiles (on the background thread: the interval's last
step, which also returns the gradients and closes the interval, and the
checkpoint's copy: "run"), then for those compiled only when first called
(`loop.compiled.wait()`: the interval's separate close, which an interval
ended by a stop or the data's end needs: "all"); the figures are `CompiledSteps.compile_seconds`,
the seconds its compiling threads spent tracing, lowering and compiling.
Set-up's own work besides compiling (reading the first batch, initializing
and placing the state, the memory plan) is `time_breakdown["setup"]`.
Ratios are TrainLoop / hand-written (medians over rounds; <= 1.2 is the
target for the step). Workloads: the small MLP (64-32-10, Adam, batch 32),
the GAN's two-optimizer step (benchmarks/general_step.py), PPO 4x4 as your
own step (benchmarks/ppo.py). Last, set-up when nothing compiles: a second
TrainLoop of the small MLP's objects against the hand-written loop's
jitted init, optimizer init and placement, both warm; and a fresh TrainLoop
resuming from a checkpoint file (`CheckpointFileReader`) against a
hand-written resume (`flax.serialization.from_bytes` of the same arrays
from a file, then placement).
"""

import argparse
import os
import statistics
import sys
import time

os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from harness import MLP, cross_entropy, hand_written_step, write_results  # noqa: E402

from flax_loop import TrainLoop, TrainTask  # noqa: E402
from flax_loop.programs import cache  # noqa: E402

X = np.random.default_rng(0).normal(size=(32, 64)).astype(np.float32)
Y = np.arange(32) % 10


def mlp():
    x, y, model, optimizer = X, Y, MLP(), optax.adam(1e-3)

    def hand():
        params = model.init(jax.random.key(0), x)["params"]
        state = (params, optimizer.init(params))
        return hand_written_step(model, optimizer, cross_entropy), (*state, x, y)

    def loop(init=None):
        task = TrainTask(model.apply, optimizer, cross_entropy, [(x, y)] * 4)
        return TrainLoop(
            init=init or model.init,
            task=task,
            rnkey=jax.random.key(0),
            n_steps=100,
            n_steps_per_checkpoint=10,
            devices=jax.devices()[:1],
            stdout=False,
        )

    hand.model, hand.optimizer = model, optimizer  # (set-up against them: `rerun_setup`)
    return hand, loop


def gan():
    import general_step as gs

    rng = np.random.default_rng(0)
    images = [rng.uniform(-1, 1, (gs.BATCH, 784)).astype(np.float32) for _ in range(2)]

    def hand():
        step, state = gs.step_and_state(images)
        return step, (state, images[0], jax.random.key(1))

    return hand, lambda: gs.train_loop(images)[0]


def ppo_4x4():
    import ppo as bench
    import ppo_cartpole

    def hand():
        params = ppo_cartpole.ActorCritic().init(jax.random.key(0), np.zeros((1, 4), np.float32))[
            "params"
        ]
        carry = jax.tree.map(jax.numpy.array, ppo_cartpole.first_carry(jax.random.key(1)))

        def iteration(*args):  # a function of its own: JAX's caches know the module's
            return bench.iteration(*args)

        step = jax.jit(iteration, donate_argnums=(0, 1, 2))
        return step, (params, ppo_cartpole.OPTIMIZER.init(params), carry, jax.random.key(2))

    def loop():
        return ppo_cartpole.make_loop(
            10**6,
            ppo_cartpole.ActorCritic().init,
            n_steps_per_checkpoint=10**6,
            stdout=False,
        )

    return hand, loop


WORKLOADS = {"mlp": mlp, "gan": gan, "ppo": ppo_4x4}


def hand_seconds(hand):
    step, args = hand()
    started = time.perf_counter()
    step.lower(*args).compile()
    return time.perf_counter() - started


def loop_seconds(make_loop):
    """Set-up's compile seconds, then with every program a run of the
    cadence compiles (those compiling on the background thread: the
    interval's closing step, the checkpoint's copy), then with the
    programs compiled only when first called too (the interval's separate
    close, for an interval ended by a stop or the data's end), and set-up's
    other seconds."""
    cache.clear()
    loop = make_loop()
    compiled = loop.compiled
    first = compiled.compile_seconds
    for name, status in compiled.status().items():
        if status == "compiling":
            compiled.copier() if name == "copy" else compiled.programs[name].result()
    run = compiled.compile_seconds
    compiled.wait()
    return first, run, compiled.compile_seconds, loop.time_breakdown["setup"]


def rerun_setup(rounds):
    """Set-up when nothing compiles: a second TrainLoop of the small MLP's
    objects (its programs in the process's cache) against the hand-written
    loop's jitted init, optimizer init and placement, warm."""
    compiled, make_loop = mlp()
    init, optimizer_init = jax.jit(compiled.model.init), jax.jit(compiled.optimizer.init)

    def hand():
        params = init(jax.random.key(0), X)["params"]
        jax.block_until_ready(jax.device_put((params, optimizer_init(params)), jax.devices()[0]))

    hand(), make_loop().compiled.wait()  # compiled, in the caches
    return alternating(hand, make_loop, rounds)


def alternating(hand, ours, rounds):
    """The medians of `hand()`'s and `ours()`'s seconds, called in turn."""
    pairs = []
    for _ in range(rounds):
        started = time.perf_counter()
        hand()
        middle = time.perf_counter()
        ours()
        pairs.append((middle - started, time.perf_counter() - middle))
    return [statistics.median(column) for column in zip(*pairs)]


def resumed_setup(rounds):
    """Set-up of a fresh TrainLoop over a directory's newest file (its
    programs in the caches) against a hand-written resume: the parameters
    and the optimizer state read from a file of their own
    (`flax.serialization`) and placed on the device."""
    import tempfile

    from flax import serialization

    from flax_loop import CheckpointFileReader, CheckpointFileWriter

    compiled, make_loop = mlp()
    directory = tempfile.mkdtemp()
    loop = make_loop()
    with CheckpointFileWriter(output_dir=directory) as write:
        write(loop.next_checkpoint())
    params = compiled.model.init(jax.random.key(0), X)["params"]
    target = (params, compiled.optimizer.init(params))
    path = os.path.join(directory, "hand.msgpack")
    with open(path, "wb") as file:
        file.write(serialization.to_bytes(jax.device_get(target)))

    def hand():
        with open(path, "rb") as file:
            state = serialization.from_bytes(target, file.read())
        jax.block_until_ready(jax.device_put(state, jax.devices()[0]))

    def resumed():
        reader = CheckpointFileReader(dir=directory, target=compiled.model.init)
        resumed = make_loop(init=reader)
        assert resumed.step == 10

    hand(), resumed()  # warm: the loop's programs and the file's pages
    return alternating(hand, resumed, rounds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=sorted(WORKLOADS))
    parser.add_argument("--json", default="benchmarks/results/compile_time.json")
    arguments = parser.parse_args()
    print(f"JAX {jax.__version__}, {os.cpu_count()} cores; medians of {arguments.rounds} rounds")
    results = {}
    for name, workload in WORKLOADS.items():
        if arguments.only and name != arguments.only:
            continue
        hand, make_loop = workload()
        hand_seconds(hand), loop_seconds(make_loop)  # imports and first traces warm
        rounds = []
        for _ in range(arguments.rounds):
            base = hand_seconds(hand)
            first, run, every, setup = loop_seconds(make_loop)
            rounds.append((base, first, run, every, setup, first / base, run / base, every / base))
        base, first, run, every, setup, first_ratio, run_ratio, every_ratio = (
            statistics.median(column) for column in zip(*rounds)
        )
        results[name] = {
            "hand_written": base,
            "loop_first": first,
            "loop_run": run,
            "loop_all": every,
            "setup_besides_compiling": setup,
            "first_ratio": first_ratio,
            "run_ratio": run_ratio,
            "all_ratio": every_ratio,
        }
        print(
            f"{name}: hand-written {base:.3f} s; TrainLoop first program {first:.3f} s "
            f"({first_ratio:.2f}x), the programs a run compiles {run:.3f} s ({run_ratio:.2f}x), "
            f"with those compiled when first called {every:.3f} s ({every_ratio:.2f}x); "
            f"set-up besides compiling {setup:.3f} s"
        )
    if not arguments.only or arguments.only == "mlp":
        base, ours = rerun_setup(5 * arguments.rounds)
        results["mlp_rerun_setup"] = {"hand_written": base, "train_loop": ours}
        print(
            f"mlp, nothing to compile: hand-written init and placement {base * 1e3:.1f} ms, "
            f"TrainLoop's set-up {ours * 1e3:.1f} ms ({ours / base:.1f}x)"
        )
        base, ours = resumed_setup(5 * arguments.rounds)
        results["mlp_resumed_setup"] = {"hand_written": base, "train_loop": ours}
        print(
            f"mlp, a fresh loop resuming from a file: hand-written read and placement "
            f"{base * 1e3:.1f} ms, TrainLoop's set-up {ours * 1e3:.1f} ms ({ours / base:.1f}x)"
        )
    write_results(arguments.json, results)


if __name__ == "__main__":
    main()
