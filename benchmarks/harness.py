"""What the benchmark scripts share: the small MLP and its loss, synthetic
batches, timing a TrainLoop, writing a script's results."""

import json
import os
import time

import flax.linen as nn
import numpy as np
import optax


class MLP(nn.Module):
    """The small MLP (64-32-10 on 64 inputs): the cheapest step, where the loop's own costs weigh most."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def hand_written_step(model, optimizer, loss):
    """`jax.jit` of the plain step a user writes: `loss(model.apply(...), y)`'s
    value and gradients, the optimizer's update; the state donated. A new
    function each call (JAX's caches do not know it)."""
    import jax

    def step(params, opt_state, x, y):
        def objective(params):
            return loss(model.apply({"params": params}, x), y)

        value, grads = jax.value_and_grad(objective)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))


def write_results(path, results):
    """`results` as JSON at `path` (its folder made), and a line saying so."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as stream:
        json.dump(results, stream, indent=1)
    print(f"wrote {path}")


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
