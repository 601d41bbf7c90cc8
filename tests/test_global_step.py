"""The step is one program over the whole batch: N devices compute what one
computes, for steps with randomness, terms over the whole batch and
per-example state. Each test trains the same program on 1, 2 and 4 of the
suite's forced CPU devices and compares the parameters (and the carry) with
plain SGD, whose update is not rescaled as Adam's is (a sum taken in another
order is all that may differ: float rounding)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_loop import (
    DATA_AXIS,
    CheckpointFileReader,
    CheckpointFileWriter,
    TrainLoop,
    TrainTask,
)
from flax_loop.random import init_key, into_collection
from tests.helpers import slow

N_STEPS, BATCH = 12, 16
ROUNDING = 1e-6  # relative to the largest parameter


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def batches(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N_STEPS * BATCH, 8)).astype(np.float32)
    y = rng.integers(0, 4, N_STEPS * BATCH).astype(np.int32)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


MLP = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(4)])


class Dropped(nn.Module):
    deterministic: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Dropout(0.5, deterministic=self.deterministic)(nn.relu(nn.Dense(32)(x)))
        return nn.Dense(4)(x)


class Normalized(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(nn.Dense(32)(x))
        return nn.Dense(4)(nn.relu(x))


def trained(model, task, n_devices, **options):
    """The loop trained N_STEPS on `n_devices`, and its last checkpoint's
    parameters, model state and carry on the host."""
    settings = {"n_steps_per_checkpoint": N_STEPS, "stdout": False, **options}
    loop = TrainLoop(
        init=model.init,
        task=task,
        rnkey=jax.random.key(0),
        n_steps=N_STEPS,
        devices=jax.devices()[:n_devices],
        **settings,
    )
    checkpoint = list(loop)[-1]
    return loop, jax.device_get((checkpoint.model_params, checkpoint.model_state, checkpoint.carry))


def relative_difference(one, other):
    pairs = list(zip(jax.tree.leaves(one), jax.tree.leaves(other), strict=True))
    largest = max(float(np.max(np.abs(a))) for a, _ in pairs)
    return max(float(np.max(np.abs(a - b))) for a, b in pairs) / largest


def assert_same_on_any_device_count(model, task, **options):
    _, one = trained(model, task, 1, **options)
    for n_devices in (2, 4):
        _, many = trained(model, task, n_devices, **options)
        assert relative_difference(one, many) < ROUNDING, n_devices
    return one


def test_dropout_draws_the_same_mask_on_any_device_count():
    model = Dropped()
    task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, data=batches())
    one = assert_same_on_any_device_count(model, task, collections={"apply": ["dropout"]})
    # dropout did act: without it the parameters differ by far more than rounding
    plain = Dropped(deterministic=True)
    task = TrainTask(plain.apply, optax.sgd(0.1), cross_entropy, data=batches())
    _, deterministic = trained(plain, task, 1)
    assert relative_difference(one, deterministic) > 1e-2


def test_noise_an_own_step_draws_from_rng_is_the_steps():
    def noisy(state, batch, *, rng, step):
        inputs, labels = batch
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(state.model(p)(inputs), labels))(
            state.params
        )
        leaves, tree = jax.tree.flatten(grads)
        keys = jax.random.split(rng, len(leaves))
        noise = [0.1 * jax.random.normal(k, g.shape) for g, k in zip(leaves, keys, strict=True)]
        grads = jax.tree.unflatten(tree, [g + n for g, n in zip(leaves, noise, strict=True)])
        return state.apply_gradients(grads), {"loss": loss}

    task = TrainTask(MLP.apply, optax.sgd(0.1), update=noisy, data=batches())
    assert_same_on_any_device_count(MLP, task)


def test_a_loss_comparing_examples_sees_the_whole_batch():
    def contrastive(model, batch, *, rng, step):
        z = model(batch[0])
        z = z / jnp.linalg.norm(z, axis=-1, keepdims=True)
        logits = z @ z.T / 0.5
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(len(z))).mean()

    task = TrainTask(MLP.apply, optax.sgd(0.1), compute_loss=contrastive, data=batches())
    assert_same_on_any_device_count(MLP, task)


def test_batchnorm_without_an_axis_name_normalizes_over_the_whole_batch():
    model = Normalized()
    task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, data=batches())
    one = assert_same_on_any_device_count(model, task, mutable_collections=["batch_stats"])
    _, statistics, _ = one
    assert float(np.max(np.abs(statistics["batch_stats"]["BatchNorm_0"]["mean"]))) > 1e-3


def test_a_carry_with_a_row_per_example_is_never_averaged():
    def recurrent(model, batch, *, rng, step, carry):
        inputs, labels = batch
        hidden = 0.5 * carry["hidden"] + model(inputs)
        return cross_entropy(hidden, labels), {}, {"hidden": jax.lax.stop_gradient(hidden)}

    task = TrainTask(
        MLP.apply,
        optax.sgd(0.1),
        compute_loss=recurrent,
        data=batches(),
        carry={"hidden": jnp.zeros((BATCH, 4))},
    )
    one = assert_same_on_any_device_count(MLP, task)
    hidden = one[2]["hidden"]
    assert hidden.shape == (BATCH, 4)
    assert float(np.std(hidden[:, 0])) > 1e-3  # one row per example, each its own


def test_a_carrys_rows_are_split_with_the_batch_and_its_other_leaves_replicated(tmp_path):
    def recurrent(model, batch, *, rng, step, carry):
        inputs, labels = batch
        hidden = 0.5 * carry["hidden"] + model(inputs)
        new = {"hidden": jax.lax.stop_gradient(hidden), "seen": carry["seen"] + 1}
        return cross_entropy(hidden, labels), {}, new

    carry = {"hidden": jnp.zeros((BATCH, 4)), "seen": jnp.zeros((3,), jnp.int32)}
    task = TrainTask(MLP.apply, optax.sgd(0.1), compute_loss=recurrent, data=batches(), carry=carry)

    def run(init):
        return TrainLoop(
            init=init,
            task=task,
            rnkey=jax.random.key(0),
            n_steps=N_STEPS,
            n_steps_per_checkpoint=6,
            devices=jax.devices()[:4],
            stdout=False,
        )

    loop = run(MLP.init)
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        for checkpoint in loop:
            if checkpoint.step == 6:
                write(checkpoint)  # the carry gathered whole into the file
    params, held = jax.device_get((checkpoint.model_params, checkpoint.carry))
    state = loop._runner.state.fields["carry"]
    assert state["hidden"].sharding.spec == jax.sharding.PartitionSpec(DATA_AXIS)
    assert state["hidden"].addressable_shards[0].data.shape == (BATCH // 4, 4)
    assert state["seen"].sharding.is_fully_replicated  # not a row per example
    assert held["seen"].tolist() == [N_STEPS] * 3
    # each device holds a quarter of the rows, and the plan says so
    assert loop.memory_plan()["carry"] == BATCH * 4 * 4 // 4 + 3 * 4
    # resumed from step 6, laid out split again: the same bits at step 12
    resumed = run(CheckpointFileReader(dir=str(tmp_path), target=MLP.init))
    assert resumed.step == 6
    ending = list(resumed)[-1]
    for a, b in zip(
        jax.tree.leaves((params, held)),
        jax.tree.leaves(jax.device_get((ending.model_params, ending.carry))),
    ):
        np.testing.assert_array_equal(a, b)


def test_a_step_written_per_device_still_trains_and_says_so(capsys):
    """BatchNorm(axis_name=DATA_AXIS), code of the per-device form, runs per
    device with a note: on N devices its statistics are over the whole batch
    (the collective), so it matches one device's run of the global step."""
    per_device = Normalized(axis_name=DATA_AXIS)
    task = TrainTask(per_device.apply, optax.sgd(0.1), cross_entropy, data=batches())
    _, many = trained(per_device, task, 2, mutable_collections=["batch_stats"], stdout=True)
    printed = " ".join(capsys.readouterr().out.split())
    assert f"names the batch axis '{DATA_AXIS}'" in printed and "runs per device" in printed
    whole = Normalized()
    _, one = trained(
        whole,
        TrainTask(whole.apply, optax.sgd(0.1), cross_entropy, data=batches()),
        1,
        mutable_collections=["batch_stats"],
    )
    assert relative_difference(one, many) < ROUNDING


def test_a_step_written_per_device_takes_a_carry_whose_rows_are_split():
    """Per-device code (BatchNorm over DATA_AXIS) with a carry of a row per
    example: the carry is laid out split with the batch, so the per-device
    step runs inside the laid-out program (it maps itself over the shards)."""

    def counting(model, batch, *, rng, step, carry):
        inputs, labels = batch
        return cross_entropy(model(inputs), labels), {}, {"seen": carry["seen"] + 1.0}

    per_device = Normalized(axis_name=DATA_AXIS)
    task = TrainTask(
        per_device.apply,
        optax.sgd(0.1),
        compute_loss=counting,
        data=batches(),
        carry={"seen": jnp.zeros((BATCH, 2))},
    )
    loop, (_, _, carry) = trained(per_device, task, 2, mutable_collections=["batch_stats"])
    assert loop._runner.state.fields["carry"]["seen"].sharding.spec == jax.sharding.PartitionSpec(
        DATA_AXIS
    )
    np.testing.assert_array_equal(carry["seen"], np.full((BATCH, 2), N_STEPS, np.float32))


@pytest.mark.parametrize("steps_per_dispatch", [1, 4])
def test_the_global_step_is_exact_across_cadence_and_dispatch(steps_per_dispatch):
    """Dropout on 2 devices: checkpoints every 3 steps and K steps a dispatch
    give the bits of one interval of 12 single steps."""
    model = Dropped()
    task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, data=batches())
    options = dict(collections={"apply": ["dropout"]})
    _, straight = trained(model, task, 2, **options)
    _, stepped = trained(
        model, task, 2, n_steps_per_checkpoint=3, steps_per_dispatch=steps_per_dispatch, **options
    )
    for a, b in zip(jax.tree.leaves(straight[0]), jax.tree.leaves(stepped[0]), strict=True):
        np.testing.assert_array_equal(a, b)


N_GRAPHS, N_NODES = 8, 24


def graph_batches():
    """Graph batches: nodes (24, 5), a graph id per node (24,), a label per
    graph (8,): arrays of different leading sizes."""
    out = []
    for seed in range(N_STEPS):
        rng = np.random.default_rng(seed)
        out.append(
            {
                "nodes": rng.normal(size=(N_NODES, 5)).astype(np.float32),
                "graph": np.sort(rng.integers(0, N_GRAPHS, N_NODES)).astype(np.int32),
                "label": rng.integers(0, 3, N_GRAPHS).astype(np.int32),
            }
        )
    return out


class GraphNet(nn.Module):
    @nn.compact
    def __call__(self, nodes, graph):
        pooled = jax.ops.segment_sum(nn.relu(nn.Dense(16)(nodes)), graph, num_segments=N_GRAPHS)
        return nn.Dense(3)(pooled)


def graph_loss(model, batch, *, rng, step):
    logits = model(batch["nodes"], batch["graph"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


@pytest.mark.parametrize(
    "n_devices",
    [
        pytest.param(2, marks=slow("3 devices: some leaves split, the labels whole")),
        3,
        pytest.param(4, marks=slow("3 devices: some leaves split, the labels whole")),
    ],
)
def test_a_graph_batch_trains_on_any_device_count_as_on_one(n_devices):
    """On 3 devices the labels (8) do not split: they are whole on every device."""
    model, data = GraphNet(), graph_batches()
    sample = (data[0]["nodes"], data[0]["graph"])
    task = TrainTask(model.apply, optax.sgd(0.1), compute_loss=graph_loss, data=data)
    _, one = trained(model, task, 1, input_sample=sample)
    loop, many = trained(model, task, n_devices, input_sample=sample)
    assert relative_difference(one, many) < ROUNDING


def sequences(lengths):
    """Sequence batches of the given lengths, 8 examples each."""
    out = []
    for seed, length in enumerate(lengths):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(8, length, 4)).astype(np.float32)
        out.append((x, (x.sum(axis=(1, 2)) > 0).astype(np.int32)))
    return out


class Pooled(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(16)(x)).mean(axis=1))


def test_batches_of_several_lengths_compile_a_step_each_when_first_met(capsys):
    """Buckets on one device: batches of lengths 16 and 24 in turn train as a
    hand-written loop of the same steps does; each new shape is said once,
    and the run does not depend on its cadence (bit for bit)."""
    model, data = Pooled(), sequences([16, 24, 16, 16, 24, 32] * 2)
    task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, data=data)

    def run(every, steps_per_dispatch=1):
        loop = TrainLoop(
            init=model.init,
            task=task,
            rnkey=jax.random.key(0),
            n_steps=N_STEPS,
            n_steps_per_checkpoint=every,
            steps_per_dispatch=steps_per_dispatch,
            devices=jax.devices()[:1],
        )
        return jax.device_get(list(loop)[-1].model_params)

    straight = run(N_STEPS)
    printed = " ".join(capsys.readouterr().out.split())
    assert printed.count("a step is compiled for them") == 2
    assert "Batches of inputs (8, 24, 4) float32; targets (8,) int32 from step 2" in printed
    assert "(shape 3 of at most 8)" in printed
    for every, group in ((3, 1), (4, 2)):
        for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(run(every, group))):
            np.testing.assert_array_equal(a, b)

    params = model.init(into_collection(init_key(jax.random.key(0)), ["params"]), data[0][0])

    @jax.jit
    def step(params, x, y):
        grads = jax.grad(lambda p: cross_entropy(model.apply(p, x), y))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    for x, y in data:
        params = step(params, x, y)
    assert relative_difference(params["params"], straight) < ROUNDING


def test_past_the_most_shapes_a_batch_is_refused_naming_the_limit():
    from flax_loop.data.source import MAX_SHAPES
    from flax_loop.errors import BatchError

    model = Pooled()
    data = sequences([8 + 4 * i for i in range(MAX_SHAPES + 1)])
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.sgd(0.1), cross_entropy, data=data),
        rnkey=jax.random.key(0),
        n_steps=MAX_SHAPES + 1,
        n_steps_per_checkpoint=MAX_SHAPES + 1,
        devices=jax.devices()[:1],
        stdout=False,
    )
    with pytest.raises(BatchError, match=rf"step {MAX_SHAPES + 1} .*at most {MAX_SHAPES} batch"):
        list(loop)
