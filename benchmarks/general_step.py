"""A GAN's step (two optimizers, a loss that calls the model and draws from
`rng`) in TrainLoop against the same alternating step hand-written, one process.

    python benchmarks/general_step.py [--rounds 7] [--steps 300]

The baseline is the step a GAN tutorial writes: a `jax.jit` function that
updates the discriminator with its optimizer, then the generator against
the updated discriminator with its own, returning both losses; batches of
images from a list, dispatch bounded as TrainLoop's is. TrainLoop runs
`TrainTask(compute_loss={...}, optimizer={...}, trainable={...})` with one
checkpoint a round. Rounds alternate the two; the ratio is the median of
per-round ratios of steps/s (TrainLoop / hand-written; >= 1 is as fast).
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
from collections import deque  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from harness import timed_loop  # noqa: E402

from flax_loop import TrainLoop, TrainTask  # noqa: E402
from flax_loop.parallel import Placement  # noqa: E402

LATENT, BATCH = 32, 64


class GAN(nn.Module):
    def setup(self):
        self.generator = nn.Sequential([nn.Dense(256), nn.relu, nn.Dense(784), jnp.tanh])
        self.discriminator = nn.Sequential([nn.Dense(256), nn.leaky_relu, nn.Dense(1)])

    def __call__(self, z, images):
        return self.discriminate(self.generate(z)), self.discriminate(images)

    def generate(self, z):
        return self.generator(z)

    def discriminate(self, images):
        return self.discriminator(images)[:, 0]


def bce(logits, target):
    return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, target)).mean()


def discriminator_loss(model, images, *, rng, step):
    fake = model(jax.random.normal(rng, (images.shape[0], LATENT)), method="generate")
    real = model(images, method="discriminate")
    made = model(jax.lax.stop_gradient(fake), method="discriminate")
    return bce(real, 1.0) + bce(made, 0.0)


def generator_loss(model, images, *, rng, step):
    fake = model(jax.random.normal(rng, (images.shape[0], LATENT)), method="generate")
    return bce(model(fake, method="discriminate"), 1.0)


OPTIMIZERS = {"discriminator": optax.adam(2e-4, b1=0.5), "generator": optax.adam(2e-4, b1=0.5)}


def step_and_state(images):
    """The tutorial's jitted step and its first state."""
    model = GAN()
    sample = (np.zeros((BATCH, LATENT), np.float32), images[0])
    params = model.init(jax.random.key(0), *sample)["params"]
    d_tx, g_tx = OPTIMIZERS["discriminator"], OPTIMIZERS["generator"]
    state = (params, d_tx.init(params["discriminator"]), g_tx.init(params["generator"]))

    def bound(params):
        return lambda *args, **kwargs: model.apply({"params": params}, *args, **kwargs)

    @jax.jit
    def step(state, images, key):
        params, d_state, g_state = state
        d_key, g_key = jax.random.split(key)

        def d_loss(d):
            return discriminator_loss(
                bound({**params, "discriminator": d}), images, rng=d_key, step=0
            )

        d_value, grads = jax.value_and_grad(d_loss)(params["discriminator"])
        updates, d_state = d_tx.update(grads, d_state, params["discriminator"])
        params = {**params, "discriminator": optax.apply_updates(params["discriminator"], updates)}

        def g_loss(g):
            return generator_loss(bound({**params, "generator": g}), images, rng=g_key, step=0)

        g_value, grads = jax.value_and_grad(g_loss)(params["generator"])
        updates, g_state = g_tx.update(grads, g_state, params["generator"])
        params = {**params, "generator": optax.apply_updates(params["generator"], updates)}
        return (params, d_state, g_state), d_value + g_value

    return step, state


def hand_written(images, depth):
    step, state = step_and_state(images)
    keys = jax.random.split(jax.random.key(1), 64)

    def run(n_steps):
        nonlocal state
        batches, in_flight = itertools.cycle(images), deque()
        started = time.perf_counter()
        for index in range(n_steps):
            state, loss = step(state, next(batches), keys[index % len(keys)])
            in_flight.append(loss)
            if len(in_flight) > depth:
                in_flight.popleft().block_until_ready()
        loss.block_until_ready()
        return time.perf_counter() - started

    return run


def train_loop(images):
    model = GAN()
    task = TrainTask(
        model.apply,
        OPTIMIZERS,
        data=itertools.cycle(images),
        compute_loss={"discriminator": discriminator_loss, "generator": generator_loss},
        trainable={"discriminator": "discriminator", "generator": "generator"},
    )
    loop = TrainLoop(
        init=model.init,
        task=task,
        rnkey=jax.random.key(0),
        input_sample=(np.zeros((BATCH, LATENT), np.float32), images[0]),
        n_steps_per_checkpoint=10**9,
        devices=jax.devices()[:1],
        stdout=False,
    )
    return loop, timed_loop(loop)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", default="benchmarks/results/general_step.json")
    arguments = parser.parse_args()
    rng = np.random.default_rng(0)
    images = [rng.uniform(-1, 1, (BATCH, 784)).astype(np.float32) for _ in range(16)]
    loop, loop_run = train_loop(images)
    baseline = hand_written(images, Placement(jax.devices()[:1]).dispatch_depth)
    baseline(20)  # compiled and warm
    loop_run(20)
    ratios, rates = [], []
    for _ in range(arguments.rounds):
        base = arguments.steps / baseline(arguments.steps)
        ours = arguments.steps / loop_run(arguments.steps)
        rates.append((base, ours))
        ratios.append(ours / base)
    base, ours = (statistics.median(column) for column in zip(*rates))
    ratio = statistics.median(ratios)
    print(
        f"JAX {jax.__version__}, {os.cpu_count()} cores; GAN 784-256 (two optimizers), "
        f"batch {BATCH}; medians of {arguments.rounds} rounds of {arguments.steps} steps"
    )
    print(f"hand-written {base:,.1f} steps/s, TrainLoop {ours:,.1f} steps/s, ratio {ratio:.2f}")
    os.makedirs(os.path.dirname(arguments.json), exist_ok=True)
    with open(arguments.json, "w") as file:
        json.dump({"hand_written": base, "train_loop": ours, "ratio": ratio}, file, indent=1)


if __name__ == "__main__":
    main()
