"""Traps found by porting published programs, each refused or said at set-up
instead of training otherwise without a word."""

import jax
import numpy as np
import optax
import pytest

from flax_loop import TrainLoop, TrainTask
from flax_loop.errors import ConfigError
from tests.helpers import MLP, cross_entropy


def test_a_dict_of_optimizers_must_say_what_each_trains():
    model = MLP(features=(8,))
    data = [(np.ones((8, 64), np.float32), np.arange(8) % 10)] * 2

    def both(model, batch, *, rng, step):
        x, y = batch
        return cross_entropy(model(x), y)

    task = TrainTask(
        model.apply,
        {"first": optax.adam(1e-3), "second": optax.adam(1e-3)},
        data=data,
        compute_loss={"first": both, "second": both},
    )
    with pytest.raises(ConfigError, match=r"say which parameters each trains.*'first': 'first'"):
        TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0), n_steps=1, stdout=False)


def test_every_writer_takes_save_frozen(tmp_path):
    from flax_loop import (
        HighestCheckpointFileWriter,
        LowestOrbaxCheckpointWriter,
        OrbaxCheckpointWriter,
    )
    from flax_loop.checkpoint import Summary, list_checkpoints, read_contents

    model = MLP(features=(8,))
    data = [(np.ones((8, 64), np.float32), np.arange(8) % 10)] * 2
    task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, data, trainable="Dense_1")
    checkpoint = TrainLoop(
        init=model.init, task=task, rnkey=jax.random.key(0), n_steps=1, stdout=False
    ).next_checkpoint()
    summary = Summary(metrics={"eval": {"accuracy": 0.5}}, **vars(checkpoint))
    writer = HighestCheckpointFileWriter(
        output_dir=str(tmp_path / "best"), metric="accuracy", stdout=False, save_frozen=False
    )
    writer(summary)
    (entry,) = list_checkpoints(str(tmp_path / "best"))
    assert read_contents(entry.path).left_out == ("/Dense_0/bias", "/Dense_0/kernel")
    for kind in (OrbaxCheckpointWriter, LowestOrbaxCheckpointWriter):
        extra = {} if kind is OrbaxCheckpointWriter else {"metric": "loss", "stdout": False}
        with pytest.raises(ConfigError, match=r"save_frozen=False\): Orbax checkpoints hold"):
            kind(output_dir=str(tmp_path / "orbax"), save_frozen=False, **extra)
