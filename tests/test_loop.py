"""TrainLoop: data-parallel equivalence, convergence, cadence, state, streams."""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_loop import DATA_AXIS, Checkpoint, EvalLoop, EvalTask, TrainLoop, TrainTask
from flax_loop.errors import ConfigError, DataExhaustedError
from tests.helpers import (
    MLP,
    BatchNormDropoutNet,
    ResumableBatches,
    accuracy,
    batches,
    cross_entropy,
    digits_loop,
    digits_split,
    relative_difference,
    slow,
)

X_TRAIN, Y_TRAIN, X_TEST, Y_TEST = digits_split()


def make_loop(n_devices=1, optimizer=None, data=None, model=None, **options):
    return digits_loop(model, optimizer, data, n_devices, **options)


@pytest.mark.parametrize(
    "optimizer",
    [optax.sgd(0.5), optax.adam(1e-2)],
    ids=["sgd", "adam"],
)
def test_four_devices_compute_what_one_device_computes(optimizer):
    # Plain SGD exposes a gradient N times too large; Adam alone would hide it.
    one = make_loop(1, optimizer, n_steps=20, n_steps_per_checkpoint=20)
    four = make_loop(4, optimizer, n_steps=20, n_steps_per_checkpoint=20)
    (single,) = list(one)
    (parallel,) = list(four)
    assert single.step == parallel.step == 20
    initial = make_loop(1, optimizer).next_step()
    moved = relative_difference(single.model_params, initial.model_params)
    assert moved > 1e-3  # the parameters really trained
    assert relative_difference(parallel.model_params, single.model_params) < 1e-5
    assert abs(parallel.loss - single.loss) <= 1e-5 * abs(single.loss)


def test_mlp_learns_digits_to_95_percent():
    model = MLP(features=(128,))
    loop = make_loop(
        4,
        optax.adam(3e-3),
        model=model,
        n_steps=400,
        n_steps_per_checkpoint=400,
        data=batches(X_TRAIN, Y_TRAIN, 64),
    )
    (checkpoint,) = list(loop)
    logits = model.apply({"params": checkpoint.model_params}, X_TEST)
    test_accuracy = float(accuracy(logits, Y_TEST).mean())
    assert test_accuracy >= 0.95, test_accuracy
    assert checkpoint.mean_loss < 0.5


def _bn_dropout_loop(rnkey, n_devices=4):
    model = BatchNormDropoutNet()
    task = TrainTask(
        apply=model.apply,
        optimizer=optax.adam(1e-2),
        loss=cross_entropy,
        data=batches(X_TRAIN, Y_TRAIN, 32),
    )
    return TrainLoop(
        init=model.init,
        task=task,
        rnkey=rnkey,
        n_steps=15,
        n_steps_per_checkpoint=15,
        collections={"init": ["params", "dropout"], "apply": ["dropout"]},
        devices=jax.devices()[:n_devices],
        stdout=False,
    )


def test_batchnorm_stats_and_dropout_keys():
    loop = _bn_dropout_loop(jax.random.key(7))
    (first,) = list(loop)
    stats = first.model_state["batch_stats"]
    mean = stats["BatchNorm_0"]["mean"]
    assert not np.allclose(mean, 0.0)  # BatchNorm's running mean starts at zeros
    # Averaged over devices: every device holds the same running statistics.
    shards = [np.asarray(shard.data) for shard in mean.addressable_shards]
    assert len(shards) == 4
    for shard in shards[1:]:
        np.testing.assert_array_equal(shard, shards[0])

    (same,) = list(_bn_dropout_loop(jax.random.key(7)))
    (other,) = list(_bn_dropout_loop(jax.random.key(8)))
    jax.tree.map(np.testing.assert_array_equal, first.model_params, same.model_params)
    assert relative_difference(first.model_params, other.model_params) > 1e-4


def test_dropout_keys_differ_per_device():
    # Every device gets the same 8 examples. Device 0 of a 4-device loop uses
    # the same key as a 1-device loop; if the other devices reused it, the
    # averaged gradient would equal the single device's gradient.
    x, y = X_TRAIN[:8], Y_TRAIN[:8]
    model = BatchNormDropoutNet()

    def first_grads(n_devices):
        data = itertools.repeat((np.tile(x, (n_devices, 1)), np.tile(y, n_devices)))
        loop = TrainLoop(
            init=model.init,
            task=TrainTask(model.apply, optax.sgd(0.1), cross_entropy, data),
            rnkey=jax.random.key(0),
            collections={"apply": ["dropout"]},
            devices=jax.devices()[:n_devices],
            stdout=False,
        )
        return loop.next_step().grads

    one, four = first_grads(1), first_grads(4)
    assert relative_difference(four, one) > 1e-3


def test_cadence_every_three_of_ten():
    loop = make_loop(2, n_steps=10, n_steps_per_checkpoint=3)
    checkpoints = list(loop)
    assert [c.step for c in checkpoints] == [3, 6, 9, 10]
    assert [c.n_completed_steps for c in checkpoints] == [3, 3, 3, 1]
    assert loop.n_steps == 10 and loop.step == 10
    assert list(loop) == []


def test_next_step_then_iteration_still_reaches_n_steps():
    loop = make_loop(1, n_steps=10, n_steps_per_checkpoint=3)
    assert loop.next_step().step == 1
    assert loop.next_step().step == 2
    assert [c.step for c in loop] == [3, 6, 9, 10]
    assert loop.n_steps == 10


def test_next_checkpoint_and_run_do_not_clobber_n_steps():
    loop = make_loop(1, n_steps=7, n_steps_per_checkpoint=3)
    assert loop.next_checkpoint().step == 3
    assert [c.step for c in loop.run(5)] == [5]
    assert loop.n_steps == 7
    assert loop.next_checkpoint().step == 6
    assert loop.next_checkpoint().step == 7  # n_steps comes before 9
    assert loop.next_checkpoint().step == 9  # past the target: keep going
    assert loop.n_steps == 7
    assert next(make_loop(1, n_steps=4, n_steps_per_checkpoint=3)).step == 3


def test_notebook_style_with_default_n_steps():
    loop = make_loop(1, n_steps_per_checkpoint=5)
    assert loop.n_steps == 0
    with pytest.raises(ConfigError, match="n_steps is 0"):  # iterating would train nothing
        list(loop)
    assert [loop.next_checkpoint().step for _ in range(3)] == [5, 10, 15]
    loop.n_steps_per_checkpoint = 2
    assert loop.next_checkpoint().step == 16
    loop.n_steps = 20
    assert [c.step for c in loop] == [18, 20]


def test_checkpoint_survives_later_steps():
    loop = make_loop(4, n_steps=30, n_steps_per_checkpoint=5)
    early = loop.next_checkpoint()
    copy = jax.tree.map(np.array, (early.model_params, early.optimizer_state, early.grads))
    for _ in loop:
        pass
    assert loop.step == 30
    again = jax.tree.map(np.array, (early.model_params, early.optimizer_state, early.grads))
    jax.tree.map(np.testing.assert_array_equal, again, copy)
    # No device axis: the arrays have the model's own shapes.
    assert early.model_params["Dense_0"]["kernel"].shape == (64, 64)


def test_exhausted_stream_ends_with_a_final_checkpoint():
    data = itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 7)
    loop = make_loop(2, data=data, n_steps=100, n_steps_per_checkpoint=3)
    steps = [c.step for c in loop]
    assert steps == [3, 6, 7]
    assert loop.step == 7
    assert list(loop) == []
    with pytest.raises(DataExhaustedError, match="after step 7"):
        loop.next_checkpoint()


def test_a_one_shot_iterator_ends_training_and_says_so(capsys):
    data = list(itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 4))
    loop = make_loop(1, data=iter(data), n_steps=10, n_steps_per_checkpoint=10, stdout=True)
    (checkpoint,) = list(loop)
    assert checkpoint.step == 4 and checkpoint.n_completed_steps == 4
    assert "ended at step 4 of 10" in capsys.readouterr().out


def test_a_list_is_read_epoch_after_epoch_with_exact_resume():
    data = list(itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 4))
    loop = make_loop(1, data=data, n_steps=10, n_steps_per_checkpoint=3, optimizer=optax.sgd(0.1))
    checkpoints = list(loop)
    assert [c.step for c in checkpoints] == [3, 6, 9, 10]
    # 10 steps over 4 batches: epoch 2, 2 batches into it.
    assert checkpoints[-1].data_state == {"flax_loop/epoch": {"epoch": 2, "batches": 2}}
    # The same 10 steps by hand, cycling through the list, give the same params.
    by_hand = make_loop(
        1,
        data=iter([data[i % 4] for i in range(10)]),
        n_steps=10,
        n_steps_per_checkpoint=10,
        optimizer=optax.sgd(0.1),
    )
    (straight,) = list(by_hand)
    assert relative_difference(checkpoints[-1].model_params, straight.model_params) == 0.0


def test_input_sample_none_trains_on_the_first_batch():
    data = list(itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 5))
    with_sample = make_loop(
        1,
        data=list(data),
        input_sample=X_TRAIN[:1],
        n_steps=5,
        n_steps_per_checkpoint=5,
        optimizer=optax.sgd(0.1),
    )
    without = make_loop(
        1, data=list(data), n_steps=5, n_steps_per_checkpoint=5, optimizer=optax.sgd(0.1)
    )
    (a,) = list(with_sample)
    (b,) = list(without)
    assert a.step == b.step == 5
    jax.tree.map(np.testing.assert_allclose, a.model_params, b.model_params)


def test_mean_loss_is_the_interval_mean():
    data = list(itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 6))
    losses = [c.loss for c in make_loop(1, data=list(data), n_steps=6)]
    loop = make_loop(1, data=list(data), n_steps=6, n_steps_per_checkpoint=3)
    first, second = list(loop)
    assert first.mean_loss == pytest.approx(np.mean(losses[:3]), rel=1e-6)
    assert second.mean_loss == pytest.approx(np.mean(losses[3:]), rel=1e-6)
    assert second.loss == pytest.approx(losses[-1], rel=1e-6)


def test_legacy_prngkey_and_typed_key_give_the_same_run():
    legacy = make_loop(1, rnkey=jax.random.PRNGKey(3), n_steps=3, n_steps_per_checkpoint=3)
    typed = make_loop(1, rnkey=jax.random.key(3), n_steps=3, n_steps_per_checkpoint=3)
    (a,), (b,) = list(legacy), list(typed)
    jax.tree.map(np.testing.assert_array_equal, a.model_params, b.model_params)


def test_list_batches_as_a_dataloader_yields_them():
    def loader():
        for x, y in batches(X_TRAIN, Y_TRAIN, 32):
            yield [x, y]

    trained = make_loop(2, data=loader(), n_steps=3, n_steps_per_checkpoint=3)
    as_tuples = make_loop(2, n_steps=3, n_steps_per_checkpoint=3)
    (checkpoint,) = list(trained)
    (reference,) = list(as_tuples)
    assert checkpoint.step == 3 and checkpoint.n_completed_steps == 3
    assert relative_difference(checkpoint.model_params, reference.model_params) == 0.0


def test_multiple_inputs_and_no_targets():
    import flax.linen as nn

    class TwoInputs(nn.Module):
        @nn.compact
        def __call__(self, a, b):
            return nn.Dense(1)(a) - nn.Dense(1)(b), nn.Dense(1)(a)

    def loss(difference, other):
        return jnp.mean(difference**2) + 0.0 * jnp.mean(other)

    rng = np.random.default_rng(0)
    data = (((rng.normal(size=(8, 3)), rng.normal(size=(8, 2))), ()) for _ in range(100))
    model = TwoInputs()
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.sgd(0.1), loss, data),
        rnkey=jax.random.key(0),
        n_steps=20,
        n_steps_per_checkpoint=20,
        stdout=False,
    )
    (checkpoint,) = list(loop)
    assert checkpoint.loss < 0.5 * loop_first_loss(model, loss)


def loop_first_loss(model, loss):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(8, 3)), rng.normal(size=(8, 2))
    variables = model.init(jax.random.fold_in(jax.random.key(0), 0), a, b)
    return float(loss(*model.apply(variables, a, b)))


def test_two_thousand_steps_on_four_devices_in_one_interval():
    small = MLP(features=(16,))
    loop = make_loop(
        4,
        model=small,
        optimizer=optax.sgd(0.05),
        n_steps=2000,
        n_steps_per_checkpoint=2000,
    )
    (checkpoint,) = list(loop)
    assert checkpoint.step == 2000 and checkpoint.n_completed_steps == 2000
    assert np.isfinite(checkpoint.loss) and checkpoint.mean_loss < 1.0
    assert checkpoint.elapsed_time > 0


def test_stdout_prints_model_size_once(capsys):
    loop = make_loop(1, stdout=True, n_steps=2, n_steps_per_checkpoint=1)
    list(loop)
    out = capsys.readouterr().out
    assert out.count("4,810 parameters") == 1
    assert "set-up" in out


def test_checkpoint_is_positional_as_in_flax_extra():
    checkpoint = Checkpoint({}, {}, (), {}, 0.5, 3, 1.5, 9)
    assert (checkpoint.step, checkpoint.n_completed_steps, checkpoint.loss) == (9, 3, 0.5)
    assert checkpoint.mean_loss is None and not checkpoint.preempted


# intervals of 9 at 4 a dispatch: 4, 4, then the closing step alone; the
# run's last 4 steps (an interval cut short) as single steps
NINES = (22, 9, {"one": 3, "last": 3, "many": 4})
# intervals of 6: 4, then the last 2 in one call that closes the interval
# (no single step); the run's last interval of 2 too
SIXES = (14, 6, {"one": 0, "last": 0, "many": 2, "many_last": 3})
OTHER_DEVICES = slow(
    "each plan runs on one device count by default: one as jit, one under shard_map"
)


@pytest.mark.parametrize(
    "n_devices, n_steps, every, calls",
    [
        (1, *NINES),
        (4, *SIXES),
        pytest.param(4, *NINES, marks=OTHER_DEVICES),
        pytest.param(1, *SIXES, marks=OTHER_DEVICES),
    ],
    ids=["1-nines", "4-sixes", "4-nines", "1-sixes"],
)
def test_several_steps_per_dispatch_match_single_steps(n_devices, n_steps, every, calls):
    model = BatchNormDropoutNet()

    def run(steps_per_dispatch):
        loop = TrainLoop(
            init=model.init,
            task=TrainTask(
                model.apply, optax.adam(1e-2), cross_entropy, ResumableBatches(X_TRAIN, Y_TRAIN, 32)
            ),
            rnkey=jax.random.key(3),
            n_steps=n_steps,
            n_steps_per_checkpoint=every,
            collections={"apply": ["dropout"]},
            devices=jax.devices()[:n_devices],
            stdout=False,
            steps_per_dispatch=steps_per_dispatch,
            prefetch=0,
        )
        loop.compiled.wait()  # every variant compiled: count the calls of each
        programs = loop.compiled.programs
        called = {}
        for name in ("one", "last", "many", "many_last"):
            variant = programs.get(name)
            if variant is not None:
                called[name] = 0

                def counted(*args, variant=variant, name=name):
                    called[name] += 1
                    return variant(*args)

                programs[name] = counted
        return list(loop), called

    (single, _), (grouped, called) = run(1), run(4)
    assert called == calls
    steps = [*range(every, n_steps, every), n_steps]
    assert [c.step for c in grouped] == [c.step for c in single] == steps
    assert [c.data_state for c in grouped] == [{"position": step} for step in steps]
    for a, b in zip(single, grouped):
        assert relative_difference(b.model_params, a.model_params) < 1e-6
        assert relative_difference(b.model_state, a.model_state) < 1e-6
        assert relative_difference(b.grads, a.grads) < 1e-5
        np.testing.assert_allclose(b.losses, a.losses, rtol=1e-6)
        assert b.loss == pytest.approx(a.loss, rel=1e-6)
        assert b.mean_loss == pytest.approx(a.mean_loss, rel=1e-6)
        assert (b.n_completed_steps, b.n_nonfinite_steps) == (a.n_completed_steps, 0)


@pytest.mark.parametrize("n_devices", [1, 4])
def test_checkpoint_grads_are_the_last_steps_averaged_gradients(n_devices):
    # With plain SGD, params(k) = params(k-1) - lr * grads(k).
    loop = make_loop(n_devices, optax.sgd(0.3), n_steps=5, n_steps_per_checkpoint=2)
    first = loop.next_checkpoint()
    second = loop.next_checkpoint()
    assert (first.step, second.step) == (2, 4)
    # The same run (same data, same key) stopped at step 3:
    step_3 = make_loop(n_devices, optax.sgd(0.3), n_steps=3, n_steps_per_checkpoint=3)
    (at_3,) = list(step_3)
    expected = jax.tree.map(
        lambda p, g: np.asarray(p) - 0.3 * np.asarray(g), at_3.model_params, second.grads
    )
    assert relative_difference(second.model_params, expected) < 1e-5
    assert relative_difference(second.grads, first.grads) > 1e-3  # a different step's


class GlobalBatchNormNet(nn.Module):
    """BatchNorm over the global batch, through flax_loop's data axis."""

    axis_name: str | None = DATA_AXIS

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(32, use_bias=False)(x)  # a bias before BatchNorm gets no gradient
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(x)
        return nn.Dense(10)(nn.relu(x))


def test_batchnorm_on_the_data_axis_makes_four_devices_compute_what_one_computes():
    def final(model, n_devices):
        loop = make_loop(
            n_devices, optax.sgd(0.1), model=model, n_steps=20, n_steps_per_checkpoint=20
        )
        return list(loop)[-1]

    one, four = final(GlobalBatchNormNet(), 1), final(GlobalBatchNormNet(), 4)
    assert relative_difference(four.model_params, one.model_params) < 1e-5
    assert relative_difference(four.model_state, one.model_state) < 1e-5
    # Without the axis, the step of the whole batch normalizes over the whole
    # batch too (written per device, with the axis, it ran per device above).
    whole = final(GlobalBatchNormNet(axis_name=None), 4)
    assert relative_difference(whole.model_params, one.model_params) < 1e-5
    assert relative_difference(whole.model_state, one.model_state) < 1e-5
    # The model evaluates with its running averages, on any number of devices.
    eval_task = EvalTask(
        functools.partial(GlobalBatchNormNet().apply, train=False),
        {"accuracy": accuracy},
        [(X_TRAIN[:64], Y_TRAIN[:64])],
    )
    accuracies = [
        EvalLoop(eval_task, jax.random.key(0), n_steps=None, n_devices=n)(one).metrics["eval"][
            "accuracy"
        ]
        for n in (1, 4)
    ]
    assert accuracies[0] == pytest.approx(accuracies[1], abs=1e-6)


def test_a_loop_with_nothing_to_train_says_why(capsys):
    loop = make_loop(1, stdout=True)  # n_steps left at its default, 0
    with pytest.raises(ConfigError, match="n_steps is 0 .*would train nothing.*n_steps=N"):
        list(loop)
    loop.n_steps = 2
    assert [checkpoint.step for checkpoint in loop] == [1, 2]
    loop.n_steps = 1  # a finished run iterated again: said, not an error
    assert list(loop) == []
    out = " ".join(capsys.readouterr().out.split())
    assert "Nothing to train: the loop is at step 2 and trains to step 1" in out
    assert "n_steps is the total" in out


def test_help_shows_the_contract_and_short_types():
    import inspect

    signature = str(inspect.signature(TrainLoop))
    assert "typing." not in signature and "Union[" not in signature and "flax.core" not in signature
    assert len(signature) < 760  # 21 arguments, public type names
    doc = inspect.getdoc(TrainLoop)
    assert doc.splitlines()[0].startswith("Trains a model and yields a `Checkpoint`")
    assert "`n_steps` is the total to train to" in " ".join(doc.split()[:60])


def loss_with_accuracy(logits, labels):
    return cross_entropy(logits, labels), {"accuracy": accuracy(logits, labels).mean()}


@pytest.mark.parametrize("n_devices", [1, 4])
def test_training_metrics_from_the_loss_are_interval_means(n_devices):
    from flax_loop.checkpoint import train_statistics

    data = list(itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 10))
    model = MLP()
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.sgd(0.0), loss_with_accuracy, iter(data)),
        rnkey=jax.random.key(0),
        n_steps=10,
        n_steps_per_checkpoint=5,
        devices=jax.devices()[:n_devices],
        stdout=False,
    )
    first, second = list(loop)
    params = {"params": first.model_params}  # a learning rate of 0: params stay

    def expected(batches_):
        scores = [np.mean(np.argmax(model.apply(params, x), -1) == y) for x, y in batches_]
        losses = [float(cross_entropy(model.apply(params, x), y)) for x, y in batches_]
        return np.mean(scores), np.mean(losses)

    for checkpoint, part in ((first, data[:5]), (second, data[5:])):
        accuracy_mean, loss_mean = expected(part)
        assert checkpoint.train_metrics["accuracy"] == pytest.approx(accuracy_mean, abs=1e-6)
        assert checkpoint.train_metrics["loss"] == pytest.approx(loss_mean, rel=1e-5)
        assert checkpoint.mean_loss == checkpoint.train_metrics["loss"]
    assert train_statistics(second)["accuracy"] == second.train_metrics["accuracy"]


def test_injected_hyperparameters_are_reported_as_the_last_step_used_them():
    schedule = optax.linear_schedule(0.1, 0.0, transition_steps=100)
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    loop = make_loop(1, optimizer, n_steps=30, n_steps_per_checkpoint=10)
    for checkpoint in loop:
        used = float(schedule(checkpoint.step - 1))  # step s's update used count s - 1
        assert checkpoint.train_metrics["learning_rate"] == pytest.approx(used, rel=1e-6)


def test_gradient_accumulation_with_multisteps_equals_one_large_batch():
    big = list(itertools.islice(batches(X_TRAIN, Y_TRAIN, 128), 3))
    micro = [(x[i : i + 32], y[i : i + 32]) for x, y in big for i in range(0, 128, 32)]
    accumulated = make_loop(
        1, optax.MultiSteps(optax.sgd(0.5), every_k_schedule=4), data=iter(micro),
        n_steps=12, n_steps_per_checkpoint=12,
    )  # fmt: skip
    plain = make_loop(1, optax.sgd(0.5), data=iter(big), n_steps=3, n_steps_per_checkpoint=3)
    (a,), (b,) = list(accumulated), list(plain)
    assert a.step == 12 and b.step == 3  # steps count micro-batches
    assert relative_difference(a.model_params, b.model_params) < 1e-5


@pytest.mark.parametrize("steps_per_dispatch", [1, 4])
def test_checkpoints_hold_every_steps_loss(steps_per_dispatch):
    # 70-step intervals: a stacked chunk of 64 losses and 6 read one by one;
    # the last interval's 10 in one padded chunk.
    every_step = [
        c.loss for c in make_loop(1, optax.sgd(0.1), n_steps=150, n_steps_per_checkpoint=1)
    ]
    loop = make_loop(
        1,
        optax.sgd(0.1),
        n_steps=150,
        n_steps_per_checkpoint=70,
        steps_per_dispatch=steps_per_dispatch,
    )
    checkpoints = list(loop)
    history = np.concatenate([c.losses for c in checkpoints])
    assert [len(c.losses) for c in checkpoints] == [70, 70, 10] and history.dtype == np.float32
    np.testing.assert_allclose(history, every_step, rtol=1e-6)
    assert checkpoints[-1].losses[-1] == np.float32(checkpoints[-1].loss)
    assert np.mean(checkpoints[0].losses) == pytest.approx(checkpoints[0].mean_loss, rel=1e-6)


@pytest.mark.parametrize(
    "model, mutable, also",
    [
        (MLP(), False, {}),  # no collection changes: what an ApplyError suggests
        (BatchNormDropoutNet(), ["batch_stats"], {"collections": {"apply": ["dropout"]}}),
    ],
    ids=["mlp-false", "batchnorm-list"],
)
def test_a_narrower_mutable_collections_still_initializes_every_collection(model, mutable, also):
    # init creates params (and batch_stats) whatever training may change; the
    # run is the default's bit for bit when those are the collections it changes.
    def run(**options):
        return list(
            digits_loop(model, n_devices=1, n_steps=4, n_steps_per_checkpoint=2, **also, **options)
        )

    narrower, default = run(mutable_collections=mutable), run()
    assert [c.step for c in narrower] == [2, 4]
    for a, b in zip(narrower, default):
        assert jax.tree.structure(a.model_state) == jax.tree.structure(b.model_state)
        for u, v in zip(
            jax.tree.leaves((a.model_params, a.model_state)),
            jax.tree.leaves((b.model_params, b.model_state)),
        ):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    if mutable == ["batch_stats"]:
        assert jax.tree.leaves(narrower[-1].model_state)  # the statistics are there and moved
        assert any(
            np.any(np.asarray(leaf) != 0) for leaf in jax.tree.leaves(narrower[-1].model_state)
        )


def test_mutable_collections_false_trains_a_linen_model_returning_bare_outputs():
    # Set-up still initializes every collection (init's mutable is not the
    # training step's); the step calls apply(..., mutable=False), which
    # returns the logits alone.
    def last(**options):
        *_, checkpoint = digits_loop(n_steps=6, n_steps_per_checkpoint=3, n_devices=1, **options)
        return checkpoint

    bare = last(mutable_collections=False)
    default = last()
    assert bare.step == 6 and bare.model_state == {}
    for a, b in zip(jax.tree.leaves(bare.model_params), jax.tree.leaves(default.model_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
