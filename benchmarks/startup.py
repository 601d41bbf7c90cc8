"""Time to the first trained step, a restarted run's set-up, and evaluation, against hand-written code.

    python benchmarks/startup.py [--rounds 5] [--only mlp|cnn|eval]

Set-up: each measurement is a fresh process (nothing compiled in memory, no
persistent cache), timed from before the model's `init` to the first step's
result on the host, imports excluded: the hand-written loop jits its init
(model and optimizer) and its step; the TrainLoop is built and returns its
first checkpoint (`next_step()`, a checkpoint at step 1). Restart: the same
TrainLoop process again, JAX's persistent compilation cache filled by a
first run, against a cold one. Rounds alternate the variants; each figure is
the median over rounds of the per-round ratio.

Eval: `EvalLoop` over 40 batches against a hand-written jitted eval step
summing the same metrics, in one process, rounds alternating.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = "--child"


def child(variant, workload):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    from flax_loop import TrainLoop, TrainTask

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.relu(nn.Dense(32)(x))
            x = nn.Dropout(0.2, deterministic=not train)(x)
            return nn.Dense(10)(x)

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            for features in (32, 64, 64):
                x = nn.Conv(features, (3, 3))(x)
                x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
                x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
            x = nn.Dropout(0.5, deterministic=not train)(x.reshape(x.shape[0], -1))
            return nn.Dense(10)(x)

    shape, model = ((784,), MLP()) if workload == "mlp" else ((28, 28, 1), CNN())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, *shape)).astype(np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)
    optimizer = optax.adam(1e-3)

    def cross_entropy(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    started = time.perf_counter()
    if variant == "hand-written":

        def init(key, x):
            variables = model.init({"params": key, "dropout": key}, x)
            params = variables.pop("params")
            return params, dict(variables), optimizer.init(params)

        def update(state, x, y, key):
            params, model_state, opt_state = state

            def loss_fn(params):
                logits, new_state = model.apply(
                    {"params": params, **model_state},
                    x,
                    rngs={"dropout": key},
                    mutable=list(model_state),
                )
                return cross_entropy(logits, y), new_state

            (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), new_state, opt_state), loss

        key = jax.random.key(0)
        state = jax.jit(init)(key, x)
        state, loss = jax.jit(update, donate_argnums=0)(state, x, y, key)
        float(loss)
    else:
        loop = TrainLoop(
            init=model.init,
            task=TrainTask(model.apply, optimizer, cross_entropy, iter([(x, y)] * 10)),
            rnkey=jax.random.key(0),
            n_steps=10,
            collections={"init": ["params", "dropout"], "apply": ["dropout"]},
            mutable_collections=True,
            devices=jax.devices()[:1],
            stdout=False,
        )
        checkpoint = loop.next_step()
        assert checkpoint.step == 1
    print(f"SECONDS {time.perf_counter() - started}", flush=True)


def run_child(variant, workload, cache=None):
    env = {"JAX_PLATFORMS": "cpu", **os.environ}  # a CPU unless told (benchmarks/on_device.sh)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    # cold: no persistent cache (a TrainLoop turns one on by default)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false" if cache is None else "true"
    if cache is not None:
        env.update(
            JAX_COMPILATION_CACHE_DIR=cache,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    output = subprocess.run(
        [sys.executable, __file__, CHILD, variant, workload],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    return float(output.split("SECONDS ")[1])


def set_up_rows(workload, rounds):
    cache = tempfile.mkdtemp(prefix="flax_loop-bench-cache-")
    run_child("TrainLoop", workload, cache)  # fills the cache
    times = {"hand-written": [], "TrainLoop": [], "TrainLoop, restarted": []}
    for _ in range(rounds):
        times["hand-written"].append(run_child("hand-written", workload))
        times["TrainLoop"].append(run_child("TrainLoop", workload))
        times["TrainLoop, restarted"].append(run_child("TrainLoop", workload, cache))
    ratio = statistics.median(t / h for t, h in zip(times["TrainLoop"], times["hand-written"]))
    restart = statistics.median(
        r / t for r, t in zip(times["TrainLoop, restarted"], times["TrainLoop"])
    )
    medians = {name: statistics.median(values) for name, values in times.items()}
    return medians, ratio, restart


def eval_row(rounds):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from flax_loop import EvalLoop, EvalTask
    from flax_loop.checkpoint import Checkpoint

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (512, 512):
                x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(10)(x)

    model = MLP()
    rng = np.random.default_rng(0)
    batches = [
        (
            rng.normal(size=(256, 784)).astype(np.float32),
            rng.integers(0, 10, 256).astype(np.int32),
        )
        for _ in range(40)
    ]
    params = model.init(jax.random.key(0), batches[0][0])["params"]

    def loss(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    def accuracy(logits, labels):
        return (jnp.argmax(logits, -1) == labels).astype(jnp.float32)

    @jax.jit
    def hand_step(params, totals, x, y):
        logits = model.apply({"params": params}, x)
        return jax.tree.map(
            jnp.add, totals, {"loss": loss(logits, y).sum(), "accuracy": accuracy(logits, y).sum()}
        )

    def hand_written():
        totals = {"loss": jnp.zeros(()), "accuracy": jnp.zeros(())}
        for x, y in batches:
            totals = hand_step(params, totals, x, y)
        n = sum(len(y) for _, y in batches)
        return {name: float(value) / n for name, value in totals.items()}

    evaluate = EvalLoop(
        EvalTask(
            apply=model.apply,
            metrics={"loss": loss, "accuracy": accuracy},
            data=batches,
        ),
        rnkey=jax.random.key(0),
        n_steps=None,
        devices=jax.devices()[:1],
    )
    checkpoint = Checkpoint(params, {}, (), {}, 0.0, 1, 0.0, 1)

    def managed():
        return evaluate(checkpoint).metrics["eval"]

    expected = hand_written()
    got = managed()
    assert all(abs(got[name] - expected[name]) < 1e-5 for name in expected), (got, expected)
    times = {"hand-written": [], "EvalLoop": []}
    for _ in range(rounds):
        for name, run in (("hand-written", hand_written), ("EvalLoop", managed)):
            started = time.perf_counter()
            for _ in range(5):
                run()
            times[name].append(time.perf_counter() - started)
    return statistics.median(h / e for h, e in zip(times["hand-written"], times["EvalLoop"]))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=["mlp", "cnn", "eval"], default=None)
    parser.add_argument("--json", default=os.path.join("benchmarks", "results", "startup.json"))
    args = parser.parse_args()
    results = {}
    names = {"mlp": "MLP 784-32-10 + Dropout", "cnn": "CNN 3 conv + BatchNorm + Dropout"}
    print(f"{os.cpu_count()} cores, 1 device; medians of {args.rounds} rounds (fresh processes)")
    for workload in ("mlp", "cnn"):
        if args.only and args.only != workload:
            continue
        medians, ratio, restart = set_up_rows(workload, args.rounds)
        results[workload] = {"seconds": medians, "ratio": ratio, "restart_ratio": restart}
        print(
            f"{names[workload]:<34} first step: hand-written {medians['hand-written']:.2f} s, "
            f"TrainLoop {medians['TrainLoop']:.2f} s ({ratio:.2f}x); restarted "
            f"{medians['TrainLoop, restarted']:.2f} s ({restart:.2f}x of cold)"
        )
    if not args.only or args.only == "eval":
        ratio = eval_row(args.rounds)
        results["eval"] = {"ratio": ratio}
        print(f"{'EvalLoop, MLP 784-512-512-10':<34} {ratio:.2f} of a hand-written jitted eval")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as out:
        json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
