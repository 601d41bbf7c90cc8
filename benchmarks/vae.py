"""Short intervals: a VAE trained as Flax's VAE example trains it (an
evaluation after every epoch of 11 steps), through TrainLoop and as the
example writes it (a jitted step, a jitted evaluation), in one process.

    python benchmarks/vae.py [--rounds 5] [--epochs 10] [--pixels 784]

Our port of the example's model and loss: an encoder 784-500-(20, 20), a
decoder 20-500-784, the reparameterization drawn from the step's key,
binary cross-entropy plus KL divergence, Adam 1e-3, batches of 128. The
data are synthetic binarized images (no download): 11 batches an epoch, a
test set of 1,024. TrainLoop runs `TrainTask(compute_loss=...)` over the
batches as bare arrays, a checkpoint an epoch; at each checkpoint (and
after each epoch of the hand-written loop) the same jitted evaluation
reads the test loss to the host. Rounds alternate the two; the ratio is
the median of per-round ratios of steps a second (TrainLoop /
hand-written; >= 1.0 is the target). Two evaluations: jitted, and as the
example's train.py runs it, op by op (not jitted: the host dispatches each
operation, and a loop that waited for its devices before the body would
add the interval's last steps to that host work, where a hand-written
loop overlaps them). The script also times one interval's close alone: a
TrainLoop of one step an interval, its steps' time taken out.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from flax_loop import TrainLoop, TrainTask  # noqa: E402

LATENTS, BATCH, STEPS_PER_EPOCH = 20, 128, 11
PIXELS = 784  # --pixels: 64 is the digits' size, where a step costs less than the evaluation


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(500)(x))
        return nn.Dense(LATENTS)(x), nn.Dense(LATENTS)(x)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, z):
        return nn.Dense(PIXELS)(nn.relu(nn.Dense(500)(z)))


class VAE(nn.Module):
    def setup(self):
        self.encoder, self.decoder = Encoder(), Decoder()

    def __call__(self, x, key):
        mean, logvar = self.encoder(x)
        z = mean + jax.random.normal(key, logvar.shape) * jnp.exp(0.5 * logvar)
        return self.decoder(z), mean, logvar


def losses(logits, x, mean, logvar):
    log_p = nn.log_sigmoid(logits)
    bce = -jnp.sum(x * log_p + (1.0 - x) * jnp.log(-jnp.expm1(log_p)), axis=-1).mean()
    kld = (-0.5 * jnp.sum(1 + logvar - mean**2 - jnp.exp(logvar), axis=-1)).mean()
    return bce, kld


def vae_loss(model, batch, *, rng, step):
    logits, mean, logvar = model(batch, rng)
    bce, kld = losses(logits, batch, mean, logvar)
    return bce + kld


MODEL = VAE()
OPTIMIZER = optax.adam(1e-3)


def data(seed=0):
    rng = np.random.default_rng(seed)
    train = [(rng.random((BATCH, PIXELS)) > 0.7).astype(np.float32) for _ in range(STEPS_PER_EPOCH)]
    test = (rng.random((1024, PIXELS)) > 0.7).astype(np.float32)
    return train, test


def evaluate_op_by_op(params, images, key):
    logits, mean, logvar = MODEL.apply({"params": params}, images, key)
    bce, kld = losses(logits, images, mean, logvar)
    return bce + kld


evaluate = jax.jit(evaluate_op_by_op)
EVALUATIONS = {"jitted": evaluate, "op by op": evaluate_op_by_op}


def hand_written(train, test, evaluate=evaluate):
    """The example's loop: a jitted step, a key split a step, an evaluation an epoch."""

    @jax.jit
    def train_step(params, opt_state, batch, key):
        def loss_fn(params):
            logits, mean, logvar = MODEL.apply({"params": params}, batch, key)
            bce, kld = losses(logits, batch, mean, logvar)
            return bce + kld

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = MODEL.init(jax.random.key(0), train[0], jax.random.key(1))["params"]
    state = [params, OPTIMIZER.init(params), jax.random.key(2)]
    eval_key = jax.random.key(3)

    def run(epochs):
        started = time.perf_counter()
        params, opt_state, rng = state
        for _ in range(epochs):
            for batch in train:
                rng, key = jax.random.split(rng)
                params, opt_state = train_step(params, opt_state, batch, key)
            float(evaluate(params, test, eval_key))
        state[:] = params, opt_state, rng
        return time.perf_counter() - started

    return run


def train_loop(train, test, every=STEPS_PER_EPOCH, evaluate=evaluate):
    loop = TrainLoop(
        init=MODEL.init,
        task=TrainTask(MODEL.apply, OPTIMIZER, data=train, compute_loss=vae_loss),
        rnkey=jax.random.key(0),
        input_sample=(train[0], jax.random.key(1)),
        n_steps_per_checkpoint=every,
        devices=jax.devices()[:1],
        stdout=False,
    )
    eval_key = jax.random.key(3)

    def run(epochs):
        started = time.perf_counter()
        for checkpoint in loop.run(loop.step + epochs * STEPS_PER_EPOCH):
            float(evaluate(checkpoint.model_params, test, eval_key))
        return time.perf_counter() - started

    return loop, run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--pixels", type=int, default=PIXELS)
    parser.add_argument("--json", default="benchmarks/results/vae.json")
    arguments = parser.parse_args()
    globals()["PIXELS"] = arguments.pixels
    train, test = data()
    steps = arguments.epochs * STEPS_PER_EPOCH
    measured = {}
    for name, evaluation in EVALUATIONS.items():
        base_run = hand_written(train, test, evaluation)
        loop, loop_run = train_loop(train, test, evaluate=evaluation)
        base_run(1), loop_run(1)  # compiled and warm
        loop.compiled.wait()
        rounds = []
        for _ in range(arguments.rounds):
            base = steps / base_run(arguments.epochs)
            ours = steps / loop_run(arguments.epochs)
            rounds.append((base, ours, ours / base))
        measured[name] = [statistics.median(column) for column in zip(*rounds)]
    base, ours, ratio = measured["jitted"]
    breakdown = loop.time_breakdown
    # one interval's close: intervals of one step against one long interval
    every_step, _ = train_loop(train, test, every=1)
    one_long, _ = train_loop(train, test, every=10**9)
    closes = []
    for warm in (every_step, one_long):  # compiled and warm
        for _ in warm.run(warm.step + 2):
            pass
        warm.compiled.wait()
    for _ in range(arguments.rounds):
        started = time.perf_counter()
        for _ in every_step.run(every_step.step + steps):
            pass
        each = time.perf_counter() - started
        started = time.perf_counter()
        for _ in one_long.run(one_long.step + steps):
            pass
        closes.append((each - (time.perf_counter() - started)) / steps)
    close = statistics.median(closes)
    print(
        f"JAX {jax.__version__}, {os.cpu_count()} cores; VAE {PIXELS}-500-20, batch {BATCH}, "
        f"{STEPS_PER_EPOCH} steps an epoch, an evaluation an epoch; medians of "
        f"{arguments.rounds} rounds of {arguments.epochs} epochs"
    )
    for name, (base, ours, ratio) in measured.items():
        print(
            f"evaluation {name}: hand-written {1e3 / base:.3f} ms a step, TrainLoop "
            f"{1e3 / ours:.3f} ms a step, ratio {ratio:.2f}"
        )
    print("TrainLoop's time:", {k: round(v, 3) for k, v in breakdown.items()})
    print(f"one interval's close (a checkpoint): {close * 1e6:.0f} us")
    os.makedirs(os.path.dirname(arguments.json), exist_ok=True)
    with open(arguments.json, "w") as stream:
        json.dump(
            {
                **{
                    name: {"hand_written": base, "train_loop": ours, "ratio": ratio}
                    for name, (base, ours, ratio) in measured.items()
                },
                "close_seconds": close,
            },
            stream,
            indent=1,
        )
    print(f"wrote {arguments.json}")


if __name__ == "__main__":
    main()
