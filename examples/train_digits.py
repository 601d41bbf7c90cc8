"""Trains an MLP on scikit-learn's bundled digits, with checkpoints and resume.

    python examples/train_digits.py --output-dir runs/digits

Every 100 steps the checkpoint is evaluated on held-out digits, printed,
written to TensorBoard (if tensorboardX is installed) and to checkpoint files;
run the command again and training resumes from the newest file.
"""

import argparse
import os
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import redex
from sklearn.datasets import load_digits

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
    EvalLoop,
    EvalTask,
    HighestCheckpointFileWriter,
    TrainLoop,
    TrainTask,
)
from flax_loop.output.console import SummaryLogger


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = True) -> jnp.ndarray:
        x = nn.relu(nn.Dense(128)(x))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        return nn.Dense(10)(x)


def cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    return (jnp.argmax(logits, -1) == labels).astype(jnp.float32)


def per_example_loss(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


class Batches:
    """Shuffled batches, epoch after epoch, each epoch's order drawn from its
    number: `get_state`/`set_state` let a resumed run read on from where the
    checkpoint was taken (the loop saves the state in every checkpoint)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, seed: int):
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.position = 0

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        epoch, index = divmod(self.position, len(self.x) // self.batch_size)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.x))
        rows = order[index * self.batch_size : (index + 1) * self.batch_size]
        self.position += 1
        return self.x[rows], self.y[rows]

    def get_state(self) -> dict[str, int]:
        return {"position": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output-dir",
        default="runs/digits",
        help="where checkpoints (OUTPUT_DIR/checkpoints) and TensorBoard events go; "
        "run again with the same directory to resume (default: %(default)s)",
    )
    parser.add_argument(
        "--n-steps", type=int, default=1000, help="the total steps to train (default: %(default)s)"
    )
    parser.add_argument(
        "--n-steps-per-checkpoint",
        type=int,
        default=100,
        help="steps between evaluations and checkpoint files (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=64, help="examples a step (default: %(default)s)"
    )
    args = parser.parse_args()

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
    x_train, y_train, x_test, y_test = x[:1497], y[:1497], x[1497:], y[1497:]

    model = MLP()
    train_task = TrainTask(
        apply=model.apply,
        optimizer=optax.adam(3e-3),
        loss=cross_entropy,
        data=Batches(x_train, y_train, args.batch_size, seed=1),
    )
    eval_task = EvalTask(
        apply=partial(model.apply, train=False),
        metrics={"accuracy": accuracy, "loss": per_example_loss},
        data=[(x_test[i : i + 100], y_test[i : i + 100]) for i in range(0, 300, 100)],
    )
    checkpoints = os.path.join(args.output_dir, "checkpoints")
    loop = TrainLoop(
        init=CheckpointFileReader(dir=checkpoints, target=model.init),
        task=train_task,
        rnkey=jax.random.key(0),
        n_steps=args.n_steps,
        n_steps_per_checkpoint=args.n_steps_per_checkpoint,
        collections={"apply": ["dropout"]},
    )
    processors = [
        EvalLoop(eval_task, rnkey=jax.random.key(1), n_steps=None, devices=loop.devices),
        SummaryLogger(),
        CheckpointFileWriter(output_dir=checkpoints, keep=2),
        HighestCheckpointFileWriter(output_dir=checkpoints, metric="accuracy"),
    ]
    try:
        import tensorboardX  # noqa: F401

        from flax_loop.output.tensorboard import SummaryWriter

        processors.append(SummaryWriter(os.path.join(args.output_dir, "tensorboard")))
    except ImportError:
        pass
    process = redex.combinator.serial(*processors)

    summary = None
    for checkpoint in loop:
        summary = process(checkpoint)
    if summary is None:
        print(f"Already trained to step {loop.step:,}; checkpoints in {checkpoints}.")
        return
    accuracy_now = summary.metrics["eval"]["accuracy"]
    print(f"Final test accuracy at step {summary.step:,}: {accuracy_now:.4f}")


if __name__ == "__main__":
    main()
