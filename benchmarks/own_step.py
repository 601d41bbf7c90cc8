"""Your own step against the built-in one: `TrainTask(update=fn)` doing what
the supervised step does, in one process.

    python benchmarks/own_step.py [--rounds 7] [--steps 400]

Both loops train the same MLP with Adam on the same batches, one checkpoint a
round: the built-in step (`TrainTask(apply, optimizer, loss, data)`) and an
`update` that computes the loss, its gradient and `state.apply_gradients`.
Rounds alternate the two; the ratio is the median of per-round ratios of
steps/s (own / built-in; >= 0.97 is the target). Two models: the small MLP
64-32-10 (the loop's own cost weighs most) and the MLP 784-512-512-10.
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from harness import make_batches, timed_loop, write_results  # noqa: E402

from flax_loop import TrainLoop, TrainTask  # noqa: E402


class MLP(nn.Module):
    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for width in self.widths[:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.widths[-1])(x)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def own_update(state, batch, *, rng, step):
    x, y = batch
    loss, grads = jax.value_and_grad(lambda p: cross_entropy(state.model(p)(x), y))(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def loops(widths, inputs, batch):
    model = MLP(widths)
    data = make_batches((inputs,), batch)

    def loop(**task):
        return TrainLoop(
            init=model.init,
            task=TrainTask(model.apply, optax.adam(1e-3), data=data, **task),
            rnkey=jax.random.key(0),
            n_steps_per_checkpoint=10**9,
            devices=jax.devices()[:1],
            stdout=False,
        )

    return timed_loop(loop(loss=cross_entropy)), timed_loop(loop(update=own_update))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--json", default="benchmarks/results/own_step.json")
    arguments = parser.parse_args()
    results = {}
    print(f"JAX {jax.__version__}, {os.cpu_count()} cores; medians of {arguments.rounds} rounds")
    for name, widths, inputs, batch, steps in (
        ("mlp-64-32-10", (32, 10), 64, 32, arguments.steps),
        ("mlp-784-512-512-10", (512, 512, 10), 784, 128, max(arguments.steps // 10, 20)),
    ):
        built_in, own = loops(widths, inputs, batch)
        built_in(20), own(20)  # compiled and warm
        rates = []
        for _ in range(arguments.rounds):
            base = steps / built_in(steps)
            ours = steps / own(steps)
            rates.append((base, ours, ours / base))
        base, ours, ratio = (statistics.median(column) for column in zip(*rates))
        results[name] = {"built_in": base, "own": ours, "ratio": ratio}
        print(f"{name:20s} built-in {base:10,.1f} steps/s, own {ours:10,.1f}, ratio {ratio:.2f}")
    write_results(arguments.json, results)


if __name__ == "__main__":
    main()
