"""A program written for flax-extra 0.0.2 runs with only its imports changed."""

import os
import re

from tests.helpers import file_names

FLAX_EXTRA_PROGRAM = """
import jax
from jax import numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from redex import combinator as cb
from sklearn.datasets import load_digits
from flax_extra import random
from flax_extra.training import TrainLoop, TrainTask
from flax_extra.evaluation import EvalLoop, EvalTask
from flax_extra.checkpoint import (
    SummaryLogger,
    SummaryWriter,
    CheckpointFileReader,
    CheckpointFileWriter,
    LowestCheckpointFileWriter,
)

x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype(np.float32)


def datagen(x, y, batch_size):
    while True:
        for i in range(0, len(x) - batch_size + 1, batch_size):
            yield x[i : i + batch_size], y[i : i + batch_size]


class Model(nn.Module):
    deterministic: bool = False

    @nn.compact
    def __call__(self, inputs):
        x = nn.relu(nn.Dense(64)(inputs))
        x = nn.Dropout(rate=0.1, deterministic=self.deterministic)(x)
        return nn.Dense(10)(x)


def loss(outputs, labels):
    return optax.softmax_cross_entropy_with_integer_labels(outputs, labels).mean()


rnkeyg = random.sequence(seed=0)
model = Model
train_task = TrainTask(
    apply=model().apply,
    optimizer=optax.adam(learning_rate=0.003),
    loss=loss,
    data=datagen(x[:1500], y[:1500], 64),
)
train_loop = TrainLoop(
    init=CheckpointFileReader(dir=CHECKPOINT_DIR, target=model().init),
    task=train_task,
    rnkey=next(rnkeyg),
    n_steps_per_checkpoint=50,
    n_steps=200,
    collections=dict(init=["params"], apply=["dropout"]),
)
eval_task = EvalTask(
    apply=model(deterministic=True).apply,
    metrics=dict(lnpp=loss),
    data=datagen(x[1500:], y[1500:], 64),
)
eval_loop = EvalLoop(task=eval_task, rnkey=next(rnkeyg), n_steps=4)
process_checkpoint = cb.serial(
    eval_loop,
    SummaryLogger(),
    SummaryWriter(output_dir=TENSORBOARD_DIR),
    CheckpointFileWriter(output_dir=CHECKPOINT_DIR),
    LowestCheckpointFileWriter(output_dir=CHECKPOINT_DIR, metric="lnpp"),
)
for checkpoint in train_loop:
    summary = process_checkpoint(checkpoint)
"""


def with_imports_changed(program: str) -> str:
    return re.sub(r"^(from|import) flax_extra", r"\1 flax_loop", program, flags=re.MULTILINE)


def test_flax_extra_program_runs_with_imports_changed(tmp_path):
    program = with_imports_changed(FLAX_EXTRA_PROGRAM)
    assert program.count("flax_loop") == 4 and "flax_extra" not in program
    namespace = {
        "CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "TENSORBOARD_DIR": str(tmp_path / "tensorboard"),
    }
    exec(compile(program, "flax_extra_program.py", "exec"), namespace)
    summary = namespace["summary"]
    assert summary.step == 200
    assert summary.metrics["eval"]["lnpp"] < 0.6
    assert set(summary.metrics["train"]) >= {"loss", "seconds_per_step", "gradients_l2norm"}
    names = file_names(tmp_path / "checkpoints")
    assert "regular.200.ckpt" in names
    assert any(name.startswith("lowest.eval.lnpp.") for name in names)
    assert os.listdir(tmp_path / "tensorboard")

    # Running the same program again resumes: the loop is already at step 200.
    exec(compile(program, "flax_extra_program.py", "exec"), namespace)
    assert namespace["train_loop"].step == 200
