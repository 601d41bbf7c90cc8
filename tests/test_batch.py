"""Batch forms, normalization and validation."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_loop import TrainLoop, TrainTask
from flax_loop.data.batch import BatchSpec, normalize_batch
from flax_loop.errors import BatchError
from tests.helpers import (
    MLP,
    batches,
    cross_entropy,
    digits_loop,
    digits_split,
    relative_difference,
)

X_TRAIN, Y_TRAIN, _, _ = digits_split()
x, y = np.zeros((8, 3), np.float32), np.zeros(8, np.int32)

SGD = optax.sgd(0.1)


@pytest.mark.parametrize(
    "batch, n_inputs, n_targets",
    [
        ((x, y), 1, 1),
        ([x, y], 1, 1),
        (((x, x), (y, y)), 2, 2),
        ([[x, x], [y]], 2, 1),
        (((x,), ()), 1, 0),
        ((x, ()), 1, 0),
        ((jnp.asarray(x), y.tolist()), 1, 1),
    ],
)
def test_accepted_forms(batch, n_inputs, n_targets):
    inputs, targets = normalize_batch(batch)
    assert (len(inputs), len(targets)) == (n_inputs, n_targets)
    assert all(leaf.shape[0] == 8 for leaf in inputs + targets)


def test_float64_is_narrowed_like_jax():
    inputs, targets = normalize_batch((np.zeros((2, 3)), np.zeros(2, np.int64)))
    assert inputs[0].dtype == np.float32 and targets[0].dtype == np.int32


@pytest.mark.parametrize(
    "batch, message",
    [
        (x, "must be a pair"),
        ((x, y, y), "tuple of length 3"),
        ({"x": x, "y": y}, "got a dict"),
        (((), y), "no inputs"),
        (("text", y), r"inputs is a str \(.text.\)"),
        (([[1, 2], [3]], y), "ragged"),
    ],
)
def test_bad_forms_name_the_value(batch, message):
    with pytest.raises(BatchError, match=message):
        normalize_batch(batch)


def test_spec_names_both_shapes_when_a_batch_changes():
    spec = BatchSpec.of(normalize_batch((x, y)))
    with pytest.raises(BatchError, match=r"expected inputs \(8, 3\) float32.*got inputs \(4, 3\)"):
        spec.validate(normalize_batch((x[:4], y[:4])), step=5)
    with pytest.raises(BatchError, match="at step 5"):
        spec.validate(normalize_batch((x.astype(np.int32), y)), step=5)


def test_batch_not_divisible_by_the_device_count():
    with pytest.raises(BatchError, match=r"size 30 does not split evenly across 4 devices"):
        digits_loop(
            optimizer=SGD, data=batches(X_TRAIN, Y_TRAIN, 30), n_devices=4, n_steps=10, stdout=False
        )


def test_a_size_change_mid_run_compiles_a_step_once_and_says_so(capsys):
    """Batches of 16 after batches of 32 (on 4 devices): never a silent
    recompile; a rank change is an error naming the step."""
    stream = itertools.chain(
        itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 3), batches(X_TRAIN, Y_TRAIN, 16)
    )
    loop = digits_loop(optimizer=SGD, data=stream, n_devices=4, n_steps=10)
    assert list(loop)[-1].step == 10
    said = " ".join(capsys.readouterr().out.split())
    assert said.count("a step is compiled for them") == 1
    assert "Batches of inputs (16, 64) float32; targets (16,) int32 from step 4" in said
    ranked = itertools.chain(
        itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 3),
        ((x[:, :, None], y) for x, y in batches(X_TRAIN, Y_TRAIN, 32)),
    )
    loop = digits_loop(optimizer=SGD, data=ranked, n_devices=4, n_steps=10, stdout=False)
    with pytest.raises(BatchError, match=r"at step 4 differs .*\(32, 64\).*\(32, 64, 1\)"):
        list(loop)
    assert loop.step == 3


def test_one_compilation_per_loop(without_compilation_cache):
    compiles = []

    def listener(name, duration, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        loop = digits_loop(
            optimizer=SGD, data=batches(X_TRAIN, Y_TRAIN, 32), n_devices=4, n_steps=10, stdout=False
        )
        loop.compiled.wait()  # the variants compiling on the background thread
        assert len(compiles) >= 3  # the listener sees the set-up's compilations
        loop.n_steps_per_checkpoint = 3
        compiles.clear()
        steps = [checkpoint.step for checkpoint in loop]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert steps == [3, 6, 9, 10]
    assert compiles == []


def loader_epoch(sizes):
    """One epoch of a DataLoader-like source: batches of these sizes, in order."""
    start, epoch = 0, []
    for size in sizes:
        epoch.append((X_TRAIN[start : start + size], Y_TRAIN[start : start + size]))
        start += size
    return epoch


def test_a_short_last_batch_is_trained_on_with_one_more_compilation(without_compilation_cache):
    epoch = loader_epoch([32] * 5 + [16])
    compiles = []

    def listener(name, duration, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    loop = digits_loop(optimizer=SGD, data=iter(epoch), n_devices=4, n_steps=10, stdout=False)
    loop.n_steps, loop.n_steps_per_checkpoint = 20, 20
    loop.compiled.wait()  # the set-up's variants, compiling on the background thread
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        (checkpoint,) = list(loop)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert checkpoint.step == 6 and checkpoint.n_completed_steps == 6
    assert len(compiles) == 1  # the step for 16 examples, once
    one = digits_loop(optimizer=SGD, data=iter(epoch), n_devices=1, n_steps=10, stdout=False)
    one.n_steps, one.n_steps_per_checkpoint = 20, 20
    (reference,) = list(one)
    assert relative_difference(checkpoint.model_params, reference.model_params) < 1e-5


def test_a_short_last_batch_that_does_not_split_is_dropped_with_a_note(capsys):
    loop = digits_loop(
        optimizer=SGD,
        data=iter(loader_epoch([32] * 4 + [10])),
        n_devices=4,
        n_steps=10,
        stdout=True,
    )
    loop.n_steps, loop.n_steps_per_checkpoint = 20, 20
    (checkpoint,) = list(loop)
    assert checkpoint.step == 4
    out = " ".join(capsys.readouterr().out.split())
    assert "last batch holds 10 examples, which do not split over 4 devices: it is dropped" in out


def test_a_re_iterable_source_with_a_short_last_batch_runs_epoch_after_epoch():
    epoch = loader_epoch([32, 32, 16])
    loop = digits_loop(optimizer=SGD, data=epoch, n_devices=4, n_steps=10, stdout=False)
    loop.n_steps, loop.n_steps_per_checkpoint = 7, 3
    checkpoints = list(loop)
    assert [c.step for c in checkpoints] == [3, 6, 7]
    assert checkpoints[-1].data_state == {"flax_loop/epoch": {"epoch": 2, "batches": 1}}
    # the short batches' intervals closed apart: the separate close, built then
    assert loop.compiled.status()["close"] == "compiled"


def _grouped_run(data, steps_per_dispatch, n_steps=14):
    model = MLP()
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.sgd(0.1), cross_entropy, data),
        rnkey=jax.random.key(0),
        n_steps=n_steps,
        n_steps_per_checkpoint=n_steps,
        stdout=False,
        steps_per_dispatch=steps_per_dispatch,
        prefetch=0,  # inline from the first read
    )
    return loop, list(loop)


def test_a_group_of_steps_reads_any_batch_as_single_steps_do():
    # an epoch of five batches in three forms and a shorter last one: the
    # group reader takes the plain (x, y) quickly, the others through the checks
    sizes = [32, 32, 32, 32, 32, 16]
    starts = np.cumsum([0, *sizes])
    epoch = []
    for index, (start, size) in enumerate(zip(starts, sizes)):
        xs, ys = X_TRAIN[start : start + size], Y_TRAIN[start : start + size]
        forms = [(xs, ys), [xs, ys], ((xs,), (ys,)), (xs.astype(np.float64), ys)]
        epoch.append(forms[index % len(forms)])
    single_loop, single = _grouped_run(epoch, 1)
    grouped_loop, grouped = _grouped_run(epoch, 4)
    assert [c.step for c in grouped] == [c.step for c in single] == [14]
    assert relative_difference(grouped[-1].model_params, single[-1].model_params) < 1e-6
    np.testing.assert_allclose(grouped[-1].losses, single[-1].losses, rtol=1e-6)
    assert grouped[-1].data_state == single[-1].data_state
    assert single[-1].data_state == {"flax_loop/epoch": {"epoch": 2, "batches": 2}}


def test_a_group_of_steps_stops_where_a_one_shot_stream_ends():
    stream = itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 10)
    loop, checkpoints = _grouped_run(stream, 4)
    assert [c.step for c in checkpoints] == [10] and loop.step == 10


def test_a_group_of_steps_names_the_step_of_a_bad_or_failing_batch():
    good = list(itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 12))
    wrong = good[:6] + [(X_TRAIN[:32, :10, None], Y_TRAIN[:32])] + good[6:]
    with pytest.raises(BatchError, match=r"step 7"):
        _grouped_run(iter(wrong), 4)

    def failing():
        yield from good[:9]
        raise OSError("the disk went away")

    with pytest.raises(OSError) as raised:
        _grouped_run(failing(), 4)
    assert any("step 10" in note for note in raised.value.__notes__)


def test_a_batch_already_laid_out_as_the_step_takes_it_is_not_copied():
    # `jax.device_put(x, device)` on a loop of that one device: the array is
    # taken as it is (placing it again every step cost the reading thread
    # several times the small MLP's step); on four devices, an array
    # committed to the first is split over them.
    from flax_loop.parallel import Placement

    one, four = Placement(jax.devices()[:1]), Placement(jax.devices()[:4])
    committed = jax.device_put(x, jax.devices()[0])
    assert one.feed_batch((committed,))[0] is committed
    (moved,) = four.feed_batch((committed,))
    assert moved.sharding == four.batch_sharding
    np.testing.assert_array_equal(np.asarray(moved), x)
    # split over the four along the first axis by a mesh of the caller's own
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("rows",))
    split = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows")))
    assert four.feed_batch((split,))[0] is split


@pytest.mark.parametrize("n_devices, laid_out", [(1, "one"), (4, "one"), (4, "split")])
def test_batches_on_a_device_train_as_numpy_batches_do(n_devices, laid_out):
    host = list(itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 4))
    where = jax.devices()[0]
    if laid_out == "split":  # over the loop's devices by a mesh of the caller's own
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n_devices]), ("rows",))
        where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    on_device = jax.device_put(host, where)
    final = [
        list(digits_loop(data=data, n_devices=n_devices, n_steps=8, n_steps_per_checkpoint=4))
        for data in (host, on_device)
    ]
    assert [c.step for c in final[1]] == [4, 8]
    for a, b in zip(*(jax.tree.leaves(run[-1].model_params) for run in final)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [c.loss for c in final[0]] == [c.loss for c in final[1]]
