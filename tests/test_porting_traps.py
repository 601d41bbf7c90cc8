"""Traps found by porting published programs, each refused or said at set-up
instead of training otherwise without a word."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_loop import TrainLoop, TrainTask
from flax_loop.errors import ConfigError, LossError
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


def test_sharding_annotations_written_as_jax_tutorials_write_them():
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("data", "model"))

    class Net(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(
                64, 16, kernel_init=nnx.with_partitioning(init, NamedSharding(mesh, P(None, "model"))),
                rngs=rngs,
            )  # fmt: skip
            self.down = nnx.Linear(
                16,
                10,
                kernel_init=nnx.with_partitioning(init, NamedSharding(mesh, P("model", None))),
                rngs=rngs,
            )

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    net = Net(nnx.Rngs(0))
    data = [(np.ones((8, 64), np.float32), np.arange(8) % 10)] * 2
    loop = TrainLoop(
        init=net,
        task=TrainTask(net, optax.sgd(0.1), cross_entropy, data),
        rnkey=jax.random.key(0),
        n_steps=1,
        mesh=mesh,
        stdout=False,
    )
    checkpoint = loop.next_checkpoint()
    assert checkpoint.model_params["up"]["kernel"].sharding.spec == P(None, "model")
    assert checkpoint.model_params["down"]["kernel"].sharding.spec == P("model", None)


def test_python_control_flow_on_a_traced_value_is_named():
    from flax_loop.errors import LossError

    model = MLP(features=(8,))
    data = {"x": np.ones((8, 64), np.float32), "y": np.arange(8) % 10}

    def warmed_up(model, batch, *, rng, step):
        loss = cross_entropy(model(batch["x"]), batch["y"])
        if step > 2:  # a traced value: use jnp.where
            loss = loss * 2
        return loss

    task = TrainTask(model.apply, optax.sgd(0.1), data=[data] * 2, compute_loss=warmed_up)
    with pytest.raises(LossError, match=r"Python control flow cannot depend.*jnp.where"):
        TrainLoop(
            init=model.init,
            task=task,
            rnkey=jax.random.key(0),
            n_steps=1,
            input_sample=np.ones((1, 64), np.float32),
            stdout=False,
        )


def test_a_frozen_teacher_is_taken_when_the_loop_is_made():
    from flax import nnx

    def distilled(model, batch, *, rng, step, frozen):
        x, y = batch
        soft = jax.nn.softmax(frozen["teacher"](x))
        return -(soft * jax.nn.log_softmax(model(x))).sum(-1).mean()

    def run(change_between):
        teacher, student = (
            nnx.Linear(64, 10, rngs=nnx.Rngs(1)),
            nnx.Linear(64, 10, rngs=nnx.Rngs(2)),
        )
        data = [
            (np.random.default_rng(i).normal(size=(8, 64)).astype(np.float32), np.arange(8))
            for i in range(4)
        ]
        loop = TrainLoop(
            init=student,
            task=TrainTask(
                student,
                optax.sgd(0.1),
                data=data,
                compute_loss=distilled,
                frozen={"teacher": teacher},
            ),
            rnkey=jax.random.key(0),
            n_steps=4,
            n_steps_per_checkpoint=2,
            devices=jax.devices()[:1],
            stdout=False,
        )
        loop.next_checkpoint()
        if change_between:
            teacher.kernel[...] = jnp.zeros_like(teacher.kernel[...])
        return loop.next_checkpoint()

    changed, unchanged = run(True), run(False)
    jax.tree.map(np.testing.assert_array_equal, changed.model_params, unchanged.model_params)


def test_a_lora_model_trained_whole_is_said_at_set_up():
    import io

    from flax import nnx
    from rich.console import Console

    from flax_loop import set_console

    class LoRANet(nnx.Module):
        def __init__(self, rngs):
            self.out = nnx.LoRALinear(64, 10, lora_rank=2, rngs=rngs)

        def __call__(self, x):
            return self.out(x)

    data = [(np.ones((8, 64), np.float32), np.arange(8) % 10)] * 2
    shown = io.StringIO()
    set_console(Console(file=shown, width=300))
    for trainable in (None, nnx.LoRAParam):
        model = LoRANet(nnx.Rngs(0))
        TrainLoop(
            init=model,
            task=TrainTask(model, optax.sgd(0.1), cross_entropy, data, trainable=trainable),
            rnkey=jax.random.key(0),
            n_steps=1,
            devices=jax.devices()[:1],
        )
    said = shown.getvalue()
    assert said.count("the base too") == 1  # the run that trains the base too, alone
    assert "holds 148 LoRA parameters (nnx.LoRAParam) and every one of its 798" in said


def test_a_coordinator_port_in_use_is_named_before_jax_is_asked():
    import socket

    from flax_loop import initialize_processes

    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=rf"port {port} \('127.0.0.1:{port}'\) is in use"):
            initialize_processes(
                coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=0
            )
    finally:
        taken.close()


def test_with_the_coordinator_port_taken_both_processes_end_within_the_wait_naming_it():
    import socket
    import subprocess
    import sys

    taken = socket.socket()  # another program's listener on the coordinator's port
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    join = (
        "import os, sys; os.environ['JAX_PLATFORMS'] = 'cpu'\n"
        "from flax_loop import initialize_processes\n"
        f"initialize_processes(coordinator_address='127.0.0.1:{port}', num_processes=2, "
        "process_id=int(sys.argv[1]), initialization_timeout=1)\n"
    )
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", join, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        said = [process.communicate(timeout=120)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
        taken.close()
    assert all(process.returncode != 0 for process in processes)
    assert f"port {port} ('127.0.0.1:{port}') is in use" in said[0]  # before JAX is asked
    assert f"for the coordinator at 127.0.0.1:{port} (process 0) to answer process 1" in said[1]
    assert "at the 1 s initialization_timeout" in said[1]


def test_unclear_errors_of_the_ports_name_the_value_and_the_fix():
    import flax.linen as nn

    from flax_loop.errors import LossError

    data = [(np.ones((8, 64), np.float32), np.arange(8) % 10)] * 2

    def loop(model, loss=cross_entropy, **options):
        return TrainLoop(
            init=model.init,
            task=TrainTask(model.apply, optax.sgd(0.1), loss, data),
            rnkey=jax.random.key(0),
            n_steps=1,
            stdout=False,
            **options,
        )

    def loss_and_list(logits, labels):  # metrics as a list, not a dict by name
        return cross_entropy(logits, labels), [logits.mean(), logits.std()]

    with pytest.raises(
        LossError, match=r"returned a tuple of 2 \(.*list\).*\(loss, \{name: scalar\}\)"
    ):
        loop(MLP(features=(8,)), loss_and_list, devices=jax.devices()[:1])

    class Counted(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.param("seen", lambda key: jnp.zeros((), jnp.int32))
            return nn.Dense(10)(x)

    with pytest.raises(ConfigError, match=r"parameter seen is int32.*another collection"):
        loop(Counted(), devices=jax.devices()[:1])

    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", "model"))
            return nn.Dense(10, kernel_init=init)(x)

    with pytest.raises(ConfigError, match=r"Dense_0/kernel: it lays 'model' over more than one"):
        loop(Twice(), mesh=jax.make_mesh((2, 2), ("data", "model")))


def test_optimizers_resumed_in_another_order_are_refused(tmp_path):
    from flax_loop import CheckpointFileReader, CheckpointFileWriter
    from flax_loop.errors import CheckpointMismatchError

    model = MLP(features=(8,))
    data = {"x": np.ones((8, 64), np.float32), "y": np.arange(8) % 10}

    def loss(model, batch, *, rng, step):
        return cross_entropy(model(batch["x"]), batch["y"])

    def loop(names, init):
        return TrainLoop(
            init=init,
            task=TrainTask(
                model.apply,
                {name: optax.sgd(0.1) for name in names},
                data=[data] * 4,
                compute_loss={name: loss for name in names},
                trainable={"first": "Dense_0", "second": "Dense_1"}
                if names[0] == "first"
                else {"second": "Dense_1", "first": "Dense_0"},
            ),
            rnkey=jax.random.key(0),
            n_steps=2,
            input_sample=np.ones((1, 64), np.float32),
            devices=jax.devices()[:1],
            stdout=False,
        )

    checkpoint = loop(["first", "second"], model.init).next_checkpoint()
    assert checkpoint.optimizer_names == ("first", "second")
    CheckpointFileWriter(output_dir=str(tmp_path))(checkpoint)
    reader = CheckpointFileReader(dir=str(tmp_path), target=model.init)
    assert reader.read_newest().optimizer_names == ("first", "second")
    with pytest.raises(
        CheckpointMismatchError, match=r"order \['first', 'second'\]; the task runs \['second'"
    ):
        loop(["second", "first"], reader)
    assert loop(["first", "second"], reader).step == 1  # the same order resumes


def test_newcomer_mistakes_are_named_with_their_fix():
    from flax_loop.errors import ApplyError

    model = MLP(features=(8,))
    data = [(np.ones((8, 64), np.float32), np.arange(8) % 10)] * 2
    task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, data)
    with pytest.raises(ConfigError, match=r"input_sample is the number 40.*n_steps=\.\.\."):
        TrainLoop(model.init, task, jax.random.key(0), 40, 20)
    with pytest.raises(ConfigError, match=r"linen module MLP: pass its apply function"):
        TrainLoop(
            model.init, TrainTask(model, optax.sgd(0.1), cross_entropy, data), jax.random.key(0)
        )

    def own_keys(model, batch, *, rng, step):
        x, y = batch
        return cross_entropy(model(x, rngs={"dropout": rng}), y)

    with pytest.raises(ApplyError, match=r"with rngs=: the step gives the model its keys"):
        TrainLoop(
            model.init,
            TrainTask(model.apply, optax.sgd(0.1), data=data, compute_loss=own_keys),
            jax.random.key(0),
            n_steps=1,
            input_sample=np.ones((1, 64), np.float32),
            devices=jax.devices()[:1],
            stdout=False,
        )


def test_an_nnx_module_defaulting_to_evaluation_and_float_labels_are_named():
    from flax import nnx

    class Net(nnx.Module):  # the NNX tutorials' flag, with the default that evaluates
        def __init__(self, rngs):
            self.linear = nnx.Linear(64, 10, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x, train: bool = False):
            return self.drop(self.linear(x), deterministic=not train)

    data = [(np.ones((8, 64), np.float32), np.arange(8) % 10)] * 2
    net = Net(nnx.Rngs(0))
    with pytest.raises(
        ConfigError, match=r"Net.__call__ defaults to evaluation mode \(train=False\)"
    ):
        TrainLoop(net, TrainTask(net, optax.sgd(0.1), cross_entropy, data), jax.random.key(0))

    model = MLP(features=(8,))
    floats = [(x, y.astype(np.float32)) for x, y in data]
    with pytest.raises(
        LossError, match=r"integer class labels.*targets are \(8,\) float32.*astype"
    ):
        TrainLoop(
            model.init,
            TrainTask(model.apply, optax.sgd(0.1), cross_entropy, floats),
            jax.random.key(0),
            n_steps=1,
            devices=jax.devices()[:1],
            stdout=False,
        )
