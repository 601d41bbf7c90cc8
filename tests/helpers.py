"""Models, data and streams shared by the tests."""

import os
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits. The suite's first call keeps a copy in
    the file FLAX_LOOP_DIGITS names (tests/conftest.py sets it), so that its
    worker processes read that instead of importing scikit-learn (~1.5 s of
    CPU each)."""
    import os

    cached = os.environ.get("FLAX_LOOP_DIGITS")
    if cached and os.path.exists(cached):
        with np.load(cached) as stored:
            return stored["x"], stored["y"]
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    if cached:
        partial = f"{cached}.{os.getpid()}.npz"
        np.savez(partial, x=x, y=y)
        os.replace(partial, cached)  # whole or absent for a concurrent reader
    return x, y


def digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits, scaled to [0, 1], shuffled, 1497/300 split."""
    x, y = load_digits_arrays()
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


class FlakyBatches(ResumableBatches):
    """Raises once, at a chosen batch, then goes on; records the thread of each read."""

    def __init__(self, *args: Any, fail_at: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fail_at, self.failed = fail_at, False
        self.threads: list[str] = []

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        import threading

        self.threads.append(threading.current_thread().name)
        if self.position == self.fail_at and not self.failed:
            self.failed = True
            raise OSError("the disk holding the data went away")
        return super().__next__()


def relative_difference(a: Any, b: Any) -> float:
    """The largest relative difference between two pytrees of arrays of one structure."""
    import jax

    assert jax.tree.structure(a) == jax.tree.structure(b), (
        jax.tree.structure(a),
        jax.tree.structure(b),
    )
    diffs = jax.tree.map(
        lambda u, v: float(
            np.max(np.abs(np.asarray(u) - np.asarray(v))) / (np.max(np.abs(np.asarray(v))) + 1e-12)
        ),
        a,
        b,
    )
    return max(jax.tree.leaves(diffs))


def digits_loop(
    model: Any = None,
    optimizer: Any = None,
    data: Any = None,
    n_devices: int | None = None,
    **options: Any,
) -> Any:
    """A quiet TrainLoop on digits: an MLP, Adam 1e-2, batches of 32, key 0."""
    import jax

    from flax_loop import TrainLoop, TrainTask

    x, y, _, _ = digits_split()
    model = model or MLP()
    options.setdefault("rnkey", jax.random.key(0))
    options.setdefault("stdout", False)
    if n_devices is not None:
        options["devices"] = jax.devices()[:n_devices]
    return TrainLoop(
        init=options.pop("init", model.init),
        task=TrainTask(
            model.apply,
            optimizer or optax.adam(1e-2),
            cross_entropy,
            batches(x, y, 32) if data is None else data,
        ),
        **options,
    )


def train(n_steps: int, every: int, model: Any = None, **options: Any) -> list:
    """The checkpoints of a short digits run (see `digits_loop`)."""
    return list(digits_loop(model, n_steps=n_steps, n_steps_per_checkpoint=every, **options))


_HAND_STEPS: dict[Any, Any] = {}


def hand_trained(n_steps: int, every: int, model: Any = None, learning_rate: float = 1e-2) -> list:
    """Checkpoints such as `train(n_steps, every)` yields, made without a
    `TrainLoop`: an MLP (key 0) trained on digits by a hand-written
    `jax.jit` Adam step, each checkpoint a `Checkpoint` record with its
    statistics (the mean loss, the losses, the last gradients, the key).
    Writers, readers, evaluation and the tools take these as they take the
    loop's: tests of those rooms build no loop."""
    import jax
    import numpy as np

    from flax_loop import Checkpoint

    x, y, _, _ = digits_split()
    model = model or MLP()
    optimizer = optax.adam(learning_rate)
    key = (model, learning_rate)
    if key not in _HAND_STEPS:

        def step(params, state, inputs, labels):
            def loss_of(params):
                return cross_entropy(model.apply({"params": params}, inputs), labels)

            loss, grads = jax.value_and_grad(loss_of)(params)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss, grads

        _HAND_STEPS[key] = jax.jit(step)
    update = _HAND_STEPS[key]
    params = model.init(jax.random.key(0), x[:1])["params"]
    state, stream, checkpoints, losses = optimizer.init(params), batches(x, y, 32), [], []
    for step in range(1, n_steps + 1):
        params, state, loss, grads = update(params, state, *next(stream))
        losses.append(loss)
        if step % every == 0 or step == n_steps:
            values = np.asarray(jax.device_get(losses), np.float32)
            checkpoints.append(
                Checkpoint(
                    params,
                    {},
                    state,
                    grads,
                    loss,
                    n_completed_steps=len(values),
                    elapsed_time=0.001 * len(values),
                    step=step,
                    mean_loss=float(values.mean()),
                    train_metrics={"loss": float(values.mean())},
                    losses=values,
                    rnkey=jax.random.key(0),
                )
            )
            losses = []
    return checkpoints


def file_names(directory: Any) -> list[str]:
    """The sorted names in a directory, but writers' lock files (`.lock.*`)."""
    import os

    return sorted(name for name in os.listdir(directory) if not name.startswith(".lock."))


def directory_bytes(directory: Any) -> dict[str, bytes]:
    """Every file of a directory (but lock files) by name, with its bytes."""
    import os

    return {
        name: open(os.path.join(directory, name), "rb").read() for name in file_names(directory)
    }


ROOT = __import__("os").path.dirname(
    __import__("os").path.dirname(__import__("os").path.abspath(__file__))
)
r"""The repository's root, the working directory of worker processes."""


def resume_worker(directory: Any, n_steps: int, *args: Any) -> list[str]:
    """The command of a `tests.resume_worker` process training to `n_steps`."""
    import sys

    return [
        sys.executable, "-m", "tests.resume_worker", str(directory),
        "--n-steps", str(n_steps), *map(str, args),
    ]  # fmt: skip


def run(command: list[str], timeout: float = 300) -> str:
    """Runs a worker process to its end; its output (it must succeed)."""
    import subprocess

    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def start(command: list[str], env: dict[str, str] | None = None) -> Any:
    """Starts a worker process, its output (stdout and stderr) in a pipe."""
    import subprocess

    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def assert_same_arrays(path: Any, other: Any) -> None:
    """Two `.npz` files hold the same arrays, bit for bit."""
    a, b = np.load(path), np.load(other)
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def nnx_models() -> Any:
    """NNX models of Flax's MNIST tutorial's kind, sized for the 8x8 digits."""
    from flax import nnx

    class CNN(nnx.Module):
        """The tutorial's CNN: convolutions, BatchNorm, Dropout with its own stream."""

        def __init__(self, *, rngs: nnx.Rngs, dropout: float = 0.2):
            self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
            self.bn1 = nnx.BatchNorm(16, rngs=rngs)
            self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
            self.bn2 = nnx.BatchNorm(32, rngs=rngs)
            self.dropout = nnx.Dropout(dropout, rngs=rngs)
            self.linear1 = nnx.Linear(2 * 2 * 32, 64, rngs=rngs)
            self.linear2 = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            x = x.reshape(-1, 8, 8, 1)
            x = nnx.avg_pool(nnx.relu(self.bn1(self.conv1(x))), (2, 2), (2, 2))
            x = nnx.avg_pool(nnx.relu(self.bn2(self.conv2(x))), (2, 2), (2, 2))
            x = self.dropout(x.reshape(x.shape[0], -1))
            return self.linear2(nnx.relu(self.linear1(x)))

    class TutorialMLP(nnx.Module):
        """The other style of Flax's docs: `__call__(x, rngs=None)` passes rngs on."""

        def __init__(self, *, rngs: nnx.Rngs, dropout: float = 0.3):
            self.linear1 = nnx.Linear(64, 32, rngs=rngs)
            self.dropout = nnx.Dropout(dropout)
            self.linear2 = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x, rngs: nnx.Rngs | None = None):
            return self.linear2(self.dropout(nnx.relu(self.linear1(x)), rngs=rngs))

    class PlainMLP(nnx.Module):
        """No Dropout, no BatchNorm: N devices must match one exactly."""

        def __init__(self, *, rngs: nnx.Rngs):
            self.linear1 = nnx.Linear(64, 32, rngs=rngs)
            self.linear2 = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.linear2(nnx.relu(self.linear1(x)))

    return CNN, TutorialMLP, PlainMLP


def assert_close(a: Any, b: Any, rtol: float, atol: float) -> None:
    """Two pytrees of one structure agree leaf by leaf (numpy's allclose rule)."""
    import jax

    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


SLOW = bool(os.environ.get("FLAX_LOOP_SLOW"))
r"""FLAX_LOOP_SLOW=1: the long torture runs, every cadence row and the runs marked `slow`."""


def slow(reason: str) -> Any:
    """Marks a test that runs only with FLAX_LOOP_SLOW=1; `reason` says what
    the default suite runs instead."""
    return pytest.mark.skipif(not SLOW, reason=f"FLAX_LOOP_SLOW=1 ({reason})")
