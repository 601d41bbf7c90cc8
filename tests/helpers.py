"""Models, data and streams shared by the tests."""

from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits


def digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits, scaled to [0, 1], shuffled, 1497/300 split."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x = (x[order] / 16.0).astype(np.float32)
    y = y[order].astype(np.int32)
    return x[:1497], y[:1497], x[1497:], y[1497:]


class MLP(nn.Module):
    features: tuple[int, ...] = (64,)
    n_classes: int = 10

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        for width in self.features:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.n_classes)(x)


class BatchNormDropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = True) -> jnp.ndarray:
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.Dropout(rate=0.3, deterministic=not train)(x)
        return nn.Dense(10)(x)


def cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    return (jnp.argmax(logits, -1) == labels).astype(jnp.float32)


def batches(
    x: np.ndarray, y: np.ndarray, batch_size: int, seed: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """An endless stream of shuffled batches (the last partial batch dropped)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(x) - batch_size + 1, batch_size):
            index = order[start : start + batch_size]
            yield x[index], y[index]


class ResumableBatches:
    """A deterministic stream with get_state/set_state, as grain's iterators have."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, seed: int = 0):
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.position = 0

    def __iter__(self) -> "ResumableBatches":
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.position])
        index = rng.choice(len(self.x), self.batch_size, replace=False)
        self.position += 1
        return self.x[index], self.y[index]

    def get_state(self) -> dict[str, Any]:
        return {"position": self.position}

    def set_state(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def leaves_close(a: Any, b: Any, rtol: float) -> float:
    """The largest relative difference between two pytrees of arrays."""
    import jax

    diffs = jax.tree.map(
        lambda u, v: float(
            np.max(np.abs(np.asarray(u) - np.asarray(v))) / (np.max(np.abs(np.asarray(v))) + 1e-12)
        ),
        a,
        b,
    )
    return max(jax.tree.leaves(diffs))


def train(n_steps: int, every: int, model: Any = None, **options: Any) -> list:
    """The checkpoints of a short, quiet run on digits (Adam 1e-2, key 0)."""
    import jax

    from flax_loop import TrainLoop, TrainTask

    x, y, _, _ = digits_split()
    model = model or MLP()
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(
            model.apply,
            options.pop("optimizer", optax.adam(1e-2)),
            cross_entropy,
            batches(x, y, 32),
        ),
        rnkey=jax.random.key(0),
        n_steps=n_steps,
        n_steps_per_checkpoint=every,
        stdout=False,
        **options,
    )
    return list(loop)


def directory_bytes(directory: Any) -> dict[str, bytes]:
    """Every file of a directory by name, with its bytes."""
    import os

    return {
        name: open(os.path.join(directory, name), "rb").read()
        for name in sorted(os.listdir(directory))
    }
