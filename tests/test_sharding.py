"""Sharded state: FSDP, per-leaf rules on a user mesh, Orbax checkpoints (4 CPU devices)."""

import shutil

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
    EvalLoop,
    EvalTask,
    HighestOrbaxCheckpointWriter,
    OrbaxCheckpointReader,
    OrbaxCheckpointWriter,
    TrainLoop,
    TrainTask,
)
from flax_loop.errors import CheckpointError, CheckpointMismatchError, ConfigError
from flax_loop.programs.sharding import fsdp_spec
from tests.helpers import (
    MLP,
    BatchNormDropoutNet,
    ResumableBatches,
    accuracy,
    cross_entropy,
    digits_split,
    file_names,
    relative_difference,
    resume_worker,
    run,
    slow,
)

X, Y, X_TEST, Y_TEST = digits_split()
DROPOUT = {"apply": ["dropout"]}


def loop(model=None, optimizer=None, n_steps=20, init=None, **options):
    """A quiet loop over a resumable digits stream (the same batches every run)."""
    model = model or MLP()
    options.setdefault("rnkey", jax.random.key(0))
    options.setdefault("stdout", False)
    return TrainLoop(
        init=init or model.init,
        task=TrainTask(
            model.apply, optimizer or optax.sgd(0.1), cross_entropy, ResumableBatches(X, Y, 32)
        ),
        n_steps=n_steps,
        n_steps_per_checkpoint=n_steps,
        **options,
    )


def last(train_loop):
    return list(train_loop)[-1]


def specs(tree):
    return jax.tree.map(lambda leaf: leaf.sharding.spec, tree)


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize(
    "model, optimizer, tolerance",
    [
        (MLP(), optax.sgd(0.1), 1e-5),
        (MLP(), optax.adam(1e-2), 1e-2),
        (BatchNormDropoutNet(), optax.sgd(0.1), 1e-5),
    ],
    ids=["mlp-sgd", "mlp-adam", "batchnorm-dropout-sgd"],
)
def test_fsdp_follows_replicated(model, optimizer, tolerance):
    options = {"collections": DROPOUT} if isinstance(model, BatchNormDropoutNet) else {}
    replicated = last(loop(model, optimizer, **options))
    sharded = last(loop(model, optimizer, sharding="fsdp", fsdp_min_bytes=0, **options))
    # The parameters are split, and stay split in the checkpoint.
    kernel = sharded.model_params["Dense_0"]["kernel"]
    assert kernel.sharding.spec in (PartitionSpec("data"), PartitionSpec(None, "data"))
    assert len({shard.data.shape for shard in kernel.addressable_shards}) == 1
    assert kernel.addressable_shards[0].data.size == kernel.size // 4
    ours, theirs = host(sharded.model_params), host(replicated.model_params)
    if sharded.model_state:
        # Dense_0's bias feeds BatchNorm, which subtracts it again: its true
        # gradient is 0 and both runs hold rounding noise there (~1e-9).
        bias, other = ours["Dense_0"].pop("bias"), theirs["Dense_0"].pop("bias")
        np.testing.assert_allclose(bias, other, atol=1e-6)
    assert relative_difference(ours, theirs) < tolerance
    if sharded.model_state:  # BatchNorm's statistics
        assert relative_difference(host(sharded.model_state), host(replicated.model_state)) < 1e-5
    assert sharded.loss == pytest.approx(replicated.loss, rel=tolerance)


def test_fsdp_leaves_device_zero_a_quarter_of_the_state():
    model = MLP(features=(1024, 1024))  # kernels of 3 and 4 MiB: above FSDP's 1 MiB minimum
    x = np.random.default_rng(0).normal(size=(32, 784)).astype(np.float32)
    data = [(x, np.arange(32) % 10)]
    sizes = {}
    for sharding in ("replicated", "fsdp"):
        train = TrainLoop(
            init=model.init,
            task=TrainTask(model.apply, optax.adam(1e-3), cross_entropy, data),
            rnkey=jax.random.key(0),
            n_steps=1,
            stdout=False,
            sharding=sharding,
        )
        checkpoint = train.next_checkpoint()
        state = jax.tree.leaves((checkpoint.model_params, checkpoint.optimizer_state))
        on_device_zero = sum(
            shard.data.nbytes
            for leaf in state
            for shard in leaf.addressable_shards
            if shard.device == jax.devices()[0]
        )
        sizes[sharding] = (on_device_zero, sum(leaf.nbytes for leaf in state))
    total = sizes["fsdp"][1]
    assert total == sizes["replicated"][1] > 3 * 4 * (784 * 1024 + 1024 * 1024)  # Adam: 3x
    assert sizes["replicated"][0] == total
    assert sizes["fsdp"][0] <= 0.30 * total


def test_fsdp_keeps_small_leaves_whole_and_picks_the_largest_divisible_axis():
    assert fsdp_spec((128, 2048), 4, 4, 2**20) == PartitionSpec(None, "data")  # 1 MiB
    assert fsdp_spec((1024, 1024), 4, 4, 2**20) == PartitionSpec("data")  # the first of equals
    assert fsdp_spec((1024, 257), 4, 4, 2**20) == PartitionSpec("data")
    assert fsdp_spec((2050, 1024), 4, 4, 2**20) == PartitionSpec(None, "data")  # 4 ∤ 2050
    assert fsdp_spec((257, 1025), 4, 4, 2**20) == PartitionSpec()  # no axis divides
    assert fsdp_spec((512, 511), 4, 4, 2**20) == PartitionSpec()  # 1 MiB - 2 KiB
    checkpoint = loop(MLP(), n_steps=1, sharding="fsdp").next_checkpoint()
    assert all(spec == PartitionSpec() for spec in jax.tree.leaves(specs(checkpoint.model_params)))


def tensor_parallel(path, leaf):
    return PartitionSpec(None, "model") if path[-1] == "kernel" else PartitionSpec()


def test_a_data_model_mesh_with_split_kernels_follows_replicated():
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    replicated = last(loop(MLP(features=(64,)), devices=jax.devices()[:2]))
    split = last(loop(MLP(features=(64,)), mesh=mesh, sharding=tensor_parallel))
    assert specs(split.model_params)["Dense_0"]["kernel"] == PartitionSpec(None, "model")
    assert relative_difference(host(split.model_params), host(replicated.model_params)) < 1e-5
    # Adam's moments follow their parameters.
    train = loop(MLP(), optax.adam(1e-3), n_steps=1, mesh=mesh, sharding=tensor_parallel)
    moments = train.next_checkpoint().optimizer_state[0]
    assert specs(moments.mu)["Dense_0"]["kernel"] == PartitionSpec(None, "model")
    assert specs(moments.count) == PartitionSpec()


def test_eval_loop_evaluates_a_sharded_checkpoint():
    evaluate = EvalLoop(
        EvalTask(MLP().apply, {"accuracy": accuracy}, [(X_TEST, Y_TEST)]), rnkey=jax.random.key(1)
    )
    replicated = evaluate(last(loop()))
    sharded = evaluate(last(loop(sharding="fsdp", fsdp_min_bytes=0)))
    assert sharded.metrics["eval"]["accuracy"] == pytest.approx(
        replicated.metrics["eval"]["accuracy"], abs=1e-6
    )


def test_a_sharded_checkpoint_goes_to_a_file_and_resumes_sharded(tmp_path):
    straight = last(loop(optimizer=optax.adam(1e-2), sharding="fsdp", fsdp_min_bytes=0))
    first = loop(optimizer=optax.adam(1e-2), n_steps=10, sharding="fsdp", fsdp_min_bytes=0)
    with CheckpointFileWriter(output_dir=str(tmp_path)) as writer:
        writer(last(first))
    resumed = loop(
        optimizer=optax.adam(1e-2),
        init=CheckpointFileReader(dir=str(tmp_path), target=MLP().init),
        sharding="fsdp",
        fsdp_min_bytes=0,
    )
    assert resumed.step == 10
    ending = last(resumed)
    assert specs(ending.model_params) == specs(straight.model_params)
    states = [(c.model_params, c.optimizer_state) for c in (ending, straight)]
    for a, b in zip(*(jax.tree.leaves(host(state)) for state in states)):
        np.testing.assert_array_equal(a, b)


def orbax_run(directory, n_steps, *args):
    return run(resume_worker(directory, n_steps, "--orbax", *args), timeout=300)


@pytest.mark.parametrize(
    "sharding",
    [
        "fsdp",
        # Restoring into a replicated state is tested in this process
        # (test_orbax_checkpoint_of_four_devices_fsdp_resumes_on_two_replicated);
        # a new process's resume, by the fsdp case.
        pytest.param(
            "replicated",
            marks=slow("replicated too"),
        ),
    ],
)
def test_orbax_resume_in_a_new_process_is_bitwise_exact(tmp_path, sharding):
    # A straight run to step 20 writes steps 10 and 20; with step 20 removed,
    # its directory is that of a run stopped after step 10.
    args = ("--every", 10, "--keep", 2, "--sharding", sharding)
    orbax_run(tmp_path, 20, *args, "--out", tmp_path / "straight.npz")
    assert OrbaxCheckpointReader(dir=str(tmp_path), target=None).steps() == [10, 20]
    shutil.rmtree(tmp_path / "20")
    output = orbax_run(tmp_path, 20, *args, "--out", tmp_path / "resumed.npz")
    assert "START 10" in output and "Resumed from step 10" in output
    straight, resumed = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(straight.files) == sorted(resumed.files)
    for name in straight.files:
        np.testing.assert_array_equal(straight[name], resumed[name], err_msg=name)


def test_orbax_checkpoint_of_four_devices_fsdp_resumes_on_two_replicated(tmp_path):
    adam = optax.adam(1e-2)
    with OrbaxCheckpointWriter(output_dir=str(tmp_path), keep=2) as writer:
        for checkpoint in loop(optimizer=adam, n_steps=10, sharding="fsdp", fsdp_min_bytes=0):
            writer(checkpoint)
    assert OrbaxCheckpointReader(dir=str(tmp_path), target=None).steps() == [10]
    reader = OrbaxCheckpointReader(dir=str(tmp_path), target=MLP().init)
    resumed = loop(optimizer=adam, init=reader, devices=jax.devices()[:2])
    assert resumed.step == 10
    ending = last(resumed)
    assert all(len(leaf.sharding.device_set) == 2 for leaf in jax.tree.leaves(ending.model_params))
    straight = last(loop(optimizer=adam, devices=jax.devices()[:2]))
    assert relative_difference(host(ending.model_params), host(straight.model_params)) < 1e-5


def test_orbax_writer_keeps_the_newest_and_refuses_a_later_step(tmp_path):
    checkpoints = list(
        TrainLoop(
            init=MLP().init,
            task=TrainTask(MLP().apply, optax.sgd(0.1), cross_entropy, ResumableBatches(X, Y, 32)),
            rnkey=jax.random.key(0),
            n_steps=6,
            n_steps_per_checkpoint=2,
            stdout=False,
        )
    )
    with OrbaxCheckpointWriter(output_dir=str(tmp_path), keep=2) as writer:
        for checkpoint in checkpoints:
            writer(checkpoint)
    reader = OrbaxCheckpointReader(dir=str(tmp_path), target=MLP().init)
    assert reader.steps() == [4, 6]
    with OrbaxCheckpointWriter(output_dir=str(tmp_path)) as writer:
        with pytest.raises(CheckpointError, match="holds step 6"):
            writer(checkpoints[0])
    assert reader.steps() == [4, 6]  # nothing deleted
    with OrbaxCheckpointWriter(output_dir=str(tmp_path), overwrite=True) as writer:
        writer(checkpoints[0])
    assert reader.steps() == [2]


def test_orbax_best_writer_keeps_the_highest_metric(tmp_path):
    train = loop(n_steps=12)
    train.n_steps_per_checkpoint = 3
    evaluate = EvalLoop(
        EvalTask(MLP().apply, {"accuracy": accuracy}, [(X_TEST[:64], Y_TEST[:64])]),
        rnkey=jax.random.key(1),
    )
    accuracies = {}
    writer = HighestOrbaxCheckpointWriter(metric="accuracy", output_dir=str(tmp_path), stdout=False)
    for checkpoint in train:
        summary = writer(evaluate(checkpoint))
        accuracies[summary.step] = summary.metrics["eval"]["accuracy"]
    writer.close()
    best_step = max(accuracies, key=lambda step: (accuracies[step], -step))
    assert OrbaxCheckpointReader(dir=str(tmp_path), target=None).steps() == [best_step]
    again = HighestOrbaxCheckpointWriter(metric="accuracy", output_dir=str(tmp_path), stdout=False)
    assert again.best_metric == pytest.approx(accuracies[best_step])


def test_orbax_parameters_only_start_training_at_step_zero(tmp_path):
    import orbax.checkpoint as ocp

    pretrained = last(loop(n_steps=10))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "pretrained", pretrained.model_params)
    reader = OrbaxCheckpointReader(dir=str(tmp_path / "pretrained"), target=MLP().init)
    fine_tuned = loop(n_steps=1, init=reader, sharding="fsdp", fsdp_min_bytes=0)
    assert fine_tuned.step == 0
    first = fine_tuned.next_checkpoint()
    # The same step as a loop whose init returns the pretrained parameters.
    params = host(pretrained.model_params)
    reference = loop(n_steps=1, init=lambda *args, **kwargs: {"params": params})
    expected = reference.next_checkpoint()
    assert relative_difference(host(first.model_params), host(expected.model_params)) < 1e-6
    assert relative_difference(host(first.model_params), params) > 1e-4  # it trained


def test_orbax_checkpoint_of_another_model_is_a_mismatch(tmp_path):
    with OrbaxCheckpointWriter(output_dir=str(tmp_path)) as writer:
        writer(loop(n_steps=2).next_checkpoint())
    reader = OrbaxCheckpointReader(dir=str(tmp_path), target=MLP(features=(32,)).init)
    with pytest.raises(
        CheckpointMismatchError, match=r"model_params/Dense_0/kernel: stored \(64, 64\)"
    ):
        loop(MLP(features=(32,)), init=reader)
    assert OrbaxCheckpointReader(dir=str(tmp_path), target=None).steps() == [2]
    assert file_names(tmp_path) == ["2"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sharding": "zero3"}, "'zero3'"),
        ({"sharding": lambda path, leaf: "data"}, "PartitionSpec"),
        ({"sharding": lambda path, leaf: PartitionSpec("model")}, "no axis 'model'"),
        ({"sharding": lambda path, leaf: PartitionSpec(None, None, "data")}, "more entries"),
        ({"sharding": lambda path, leaf: PartitionSpec("data")}, "not divisible"),
        ({"mesh": "data"}, "Mesh"),
        ({"mesh": jax.make_mesh((4,), ("model",))}, "'data' axis"),
        ({"mesh": jax.make_mesh((4,), ("data",)), "devices": jax.devices()}, "not both"),
        ({"fsdp_min_bytes": -1}, "fsdp_min_bytes"),
    ],
    ids=[
        "unknown-mode",
        "not-a-spec",
        "unknown-axis",
        "too-many-entries",
        "indivisible",
        "not-a-mesh",
        "mesh-without-data",
        "devices-and-mesh",
        "negative-threshold",
    ],
)
def test_bad_sharding_arguments_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        loop(MLP(features=(30,)), n_steps=1, **options)


def test_orbax_parameters_of_another_model_are_a_mismatch(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "pretrained", loop(n_steps=1).next_checkpoint().model_params)
    reader = OrbaxCheckpointReader(dir=str(tmp_path / "pretrained"), target=MLP((32,)).init)
    with pytest.raises(CheckpointMismatchError, match=r"Dense_0/kernel: stored \(64, 64\)"):
        loop(MLP((32,)), init=reader)


def test_fsdp_steps_per_dispatch_and_skip_match_single_steps():
    options = {"sharding": "fsdp", "fsdp_min_bytes": 0, "nonfinite": "skip"}
    single = last(loop(optimizer=optax.adam(1e-2), n_steps=8, **options))
    stacked = last(loop(optimizer=optax.adam(1e-2), n_steps=8, steps_per_dispatch=4, **options))
    assert specs(stacked.model_params) == specs(single.model_params)
    assert relative_difference(host(stacked.model_params), host(single.model_params)) < 1e-6
