"""Checkpoint files without the frozen parameters (`save_frozen=False`).

A LoRA run's files keep the low-rank weights and leave the base out; a run
resumed from them takes the base from its own initialization, checked
against the digest the file keeps, and continues bit for bit.
"""

import io
import os

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from rich.console import Console

from flax_loop import CheckpointFileReader, CheckpointFileWriter, TrainLoop, TrainTask
from flax_loop.checkpoint import digest, flatten
from flax_loop.errors import CheckpointMismatchError
from flax_loop.output import cli
from tests.helpers import cross_entropy
from tests.test_general_steps import SEED, LoRANet, same, stream


def lora_loop(model, n_steps, init=None, data=None):
    return TrainLoop(
        init=init or model,
        task=TrainTask(
            model,
            optax.adam(1e-2),
            cross_entropy,
            stream("pair") if data is None else data,
            trainable=nnx.LoRAParam,
        ),
        rnkey=jax.random.key(SEED),
        n_steps=n_steps,
        n_steps_per_checkpoint=10,
        ema_decay=0.9,
        devices=jax.devices()[:1],
        stdout=False,
    )


def positioned(n_batches):
    data = stream("pair")
    for _ in range(n_batches):
        next(data)
    return data


def write_all(loop, directory, save_frozen):
    with CheckpointFileWriter(output_dir=str(directory), save_frozen=save_frozen) as write:
        for checkpoint in loop:
            write(checkpoint)
    return checkpoint


def test_a_lora_file_leaves_the_base_out_and_resumes_bitwise(tmp_path):
    straight = write_all(lora_loop(LoRANet(nnx.Rngs(0)), 20), tmp_path / "whole", True)
    first = write_all(lora_loop(LoRANet(nnx.Rngs(0)), 10), tmp_path / "lora", False)
    frozen = flatten(jax.tree.map(bool, first.frozen))
    assert sorted(path for path, is_frozen in frozen.items() if is_frozen) == [
        "/hidden/bias",
        "/hidden/kernel",
        "/out/bias",
        "/out/kernel",
    ]
    # the file holds the low-rank weights, their moments and averages only
    file = CheckpointFileReader(dir=str(tmp_path / "lora"), target=None).read_newest()
    assert sorted(flatten(file.model_params)) == [
        "/hidden/lora/lora_a",
        "/hidden/lora/lora_b",
        "/out/lora/lora_a",
        "/out/lora/lora_b",
    ]
    assert sorted(flatten(file.ema_params)) == sorted(flatten(file.model_params))
    assert file.left_out.paths == ("/hidden/bias", "/hidden/kernel", "/out/bias", "/out/kernel")
    whole_size = os.path.getsize(tmp_path / "whole" / "regular.20.ckpt")
    assert os.path.getsize(file.path) < 0.45 * whole_size  # 552 of 2,962 parameters train
    # resumed from it with the same base: the run goes on bit for bit
    model = LoRANet(nnx.Rngs(0))
    reader = CheckpointFileReader(dir=str(tmp_path / "lora"), target=model)
    *_, resumed = lora_loop(model, 20, init=reader, data=positioned(10))
    assert resumed.step == 20
    same(resumed.model_params, straight.model_params)
    same(resumed.ema_params, straight.ema_params)
    same(resumed.optimizer_state, straight.optimizer_state)
    # a frozen parameter's average is the parameter, bit for bit
    for layer in ("hidden", "out"):
        same(resumed.ema_params[layer]["kernel"], resumed.model_params[layer]["kernel"])


def test_a_base_that_changed_since_is_an_error_naming_the_file(tmp_path):
    write_all(lora_loop(LoRANet(nnx.Rngs(0)), 10), tmp_path, False)
    other = LoRANet(nnx.Rngs(1))  # another seed: another base
    reader = CheckpointFileReader(dir=str(tmp_path), target=other)
    with pytest.raises(CheckpointMismatchError) as caught:
        lora_loop(other, 20, init=reader, data=positioned(10))
    message = str(caught.value)
    assert "regular.10.ckpt left out 4 frozen parameters (/hidden/bias" in message
    assert "save_frozen=True" in message


class Tower(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="backbone")(x))
        return nn.Dense(10, name="head")(x)


def tower_loop(n_steps, init=None, data=None, rnkey=SEED, trainable="head"):
    model = Tower()
    return TrainLoop(
        init=init or model.init,
        task=TrainTask(
            model.apply,
            optax.adam(1e-2),
            cross_entropy,
            stream("pair") if data is None else data,
            trainable=trainable,  # by default a pretrained backbone stays as it is
        ),
        rnkey=jax.random.key(rnkey),
        n_steps=n_steps,
        n_steps_per_checkpoint=5,
        input_sample=(np.zeros((1, 64), np.float32),),
        devices=jax.devices()[:1],
        stdout=False,
    )


def test_linen_frozen_by_a_path_filter_resumes_bitwise_and_checks_its_key(tmp_path):
    *_, straight = tower_loop(10)
    write_all(tower_loop(5), tmp_path, False)
    file = CheckpointFileReader(dir=str(tmp_path), target=None).read_newest()
    assert file.left_out.paths == ("/backbone/bias", "/backbone/kernel")
    assert sorted(flatten(file.model_params)) == ["/head/bias", "/head/kernel"]
    shown = io.StringIO()
    assert cli.main(["show", file.path], console=Console(file=shown, width=200)) == 0
    assert "frozen parameters left out (a resume takes them from its init): " in shown.getvalue()
    assert "/backbone/bias, /backbone/kernel" in shown.getvalue()
    reader = CheckpointFileReader(dir=str(tmp_path), target=Tower().init)
    *_, resumed = tower_loop(10, init=reader, data=positioned(5))
    same(resumed.model_params, straight.model_params)
    same(resumed.optimizer_state, straight.optimizer_state)
    # another rnkey initializes another backbone: refused, not mixed
    with pytest.raises(CheckpointMismatchError, match="left out 2 frozen parameters"):
        tower_loop(10, init=reader, data=positioned(5), rnkey=SEED + 1)
    # the same intact file under another trainable filter: said so, not "damaged"
    with pytest.raises(CheckpointMismatchError, match="written with another trainable filter"):
        tower_loop(10, init=reader, data=positioned(5), trainable=None)


def test_without_frozen_parameters_the_file_holds_them_all(tmp_path):
    model = Tower()
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.sgd(0.1), cross_entropy, stream("pair")),
        rnkey=jax.random.key(SEED),
        n_steps=4,
        n_steps_per_checkpoint=4,
        input_sample=(np.zeros((1, 64), np.float32),),
        devices=jax.devices()[:1],
        stdout=False,
    )
    last = write_all(loop, tmp_path, False)
    assert last.frozen is None
    file = CheckpointFileReader(dir=str(tmp_path), target=model.init).read_newest()
    assert file.left_out is None
    assert sorted(flatten(file.model_params)) == [
        "/backbone/bias",
        "/backbone/kernel",
        "/head/bias",
        "/head/kernel",
    ]


def test_the_digest_does_not_depend_on_the_layout():
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    values = {
        "/a": np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 7,
        "/b": np.arange(12, dtype=np.int8),
        "/c": np.linspace(0, 1, 10).astype(jax.numpy.bfloat16),
    }
    split = {
        "/a": jax.device_put(
            values["/a"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        ),
        "/b": jax.device_put(values["/b"]),
        "/c": jax.device_put(values["/c"]),
    }
    paths = ("/a", "/b", "/c")
    assert digest(split, paths) == digest(values, paths)
    changed = {**values, "/a": values["/a"].copy()}
    changed["/a"][63, 7] = np.nextafter(changed["/a"][63, 7], np.float32(np.inf))
    assert digest(changed, paths) != digest(values, paths)
    swapped = {**values, "/a": values["/a"][::-1].copy()}  # the same values elsewhere
    assert digest(swapped, paths) != digest(values, paths)
