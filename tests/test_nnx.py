"""Flax NNX modules, first class: trained, evaluated, checkpointed and resumed
like linen models, without ever changing the caller's module."""

import itertools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
    EvalLoop,
    EvalTask,
    TrainLoop,
    TrainTask,
)
from flax_loop.random import step_keys, train_key
from flax_loop.step.modules import NNXModel
from tests.helpers import (
    ResumableBatches,
    accuracy,
    assert_close,
    assert_same_arrays,
    batches,
    cross_entropy,
    digits_split,
    nnx_models,
    relative_difference,
    resume_worker,
    run,
    slow,
)

X_TRAIN, Y_TRAIN, X_TEST, Y_TEST = digits_split()
CNN, TutorialMLP, PlainMLP = nnx_models()
TEST_BATCHES = [(X_TEST[i : i + 100], Y_TEST[i : i + 100]) for i in range(0, 300, 100)]


def nnx_loop(model, optimizer=None, n_devices=None, data=None, **options):
    options.setdefault("stdout", False)
    options.setdefault("rnkey", jax.random.key(0))
    if n_devices is not None:
        options["devices"] = jax.devices()[:n_devices]
    return TrainLoop(
        init=options.pop("init", model),
        task=TrainTask(
            model,
            optimizer or optax.adamw(3e-3),
            cross_entropy,
            batches(X_TRAIN, Y_TRAIN, 32) if data is None else data,
        ),
        **options,
    )


def values(model):
    """Copies of a module's parameters and batch statistics."""
    state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    return jax.tree.map(np.array, nnx.to_pure_dict(state))


def test_the_tutorial_cnn_learns_digits_and_evaluates_as_the_module_does():
    model = CNN(rngs=nnx.Rngs(0))
    before = values(model)
    loop = nnx_loop(  # notebooks/nnx.ipynb trains the same network to 0.95 in 600 steps
        model, n_steps=100, n_steps_per_checkpoint=50, collections={"apply": ["dropout"]}
    )
    evaluate = EvalLoop(
        EvalTask(model, {"accuracy": accuracy}, TEST_BATCHES), jax.random.key(1), n_steps=None
    )
    summaries = [evaluate(checkpoint) for checkpoint in loop]
    final = summaries[-1]
    assert final.metrics["eval"]["accuracy"] >= 0.85
    # Training never touched the caller's module...
    jax.tree.map(np.testing.assert_array_equal, before, values(model))
    # ...until the checkpoint is put back; then it evaluates as EvalLoop did.
    nnx.update(model, final.model_params, final.model_state)
    model.eval()
    predictions = np.argmax(np.asarray(model(X_TEST)), -1)
    assert final.metrics["eval"]["accuracy"] == pytest.approx(
        np.mean(predictions == Y_TEST), abs=1e-6
    )
    assert "bn1" in final.model_state and "mean" in final.model_state["bn1"]


@pytest.mark.parametrize("optimizer", [optax.sgd(0.5), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_four_devices_compute_what_one_device_computes(optimizer):
    def final(n_devices):
        model = PlainMLP(rngs=nnx.Rngs(0))
        return list(nnx_loop(model, optimizer, n_devices, n_steps=20, n_steps_per_checkpoint=20))[
            -1
        ]

    one, four = final(1), final(4)
    assert relative_difference(one.model_params, four.model_params) < 1e-5


def test_each_device_draws_its_own_dropout_masks():
    model = CNN(rngs=nnx.Rngs(0), dropout=0.5)
    functional = NNXModel(model, train=True)
    variables = functional.init(None, X_TRAIN[:8])
    key = train_key(jax.random.key(0))
    outputs = [
        np.asarray(
            functional.apply(variables, X_TRAIN[:8], rngs=step_keys(key, 1, device, ["default"]))
        )
        for device in range(4)
    ]
    for a, b in itertools.combinations(outputs, 2):
        assert not np.allclose(a, b)
    # Without reseeding, the module's own stream gives every device the same mask.
    same = [np.asarray(functional.apply(variables, X_TRAIN[:8])) for _ in range(2)]
    np.testing.assert_array_equal(same[0], same[1])


def test_dropout_on_four_devices_is_not_four_copies_of_one():
    # Each device gets the same 8 examples: with one shared mask, 4 devices would
    # compute exactly what 1 device computes on those 8.
    x, y = X_TRAIN[:8], Y_TRAIN[:8]
    tiled = itertools.repeat((np.tile(x, (4, 1)), np.tile(y, 4)))
    single = itertools.repeat((x, y))

    def final(data, n_devices):
        model = TutorialMLP(rngs=nnx.Rngs(0), dropout=0.5)
        loop = nnx_loop(
            model, optax.sgd(0.1), n_devices, data, n_steps=5, n_steps_per_checkpoint=5,
            collections={"apply": ["dropout"]},
        )  # fmt: skip
        return list(loop)[-1]

    assert relative_difference(final(tiled, 4).model_params, final(single, 1).model_params) > 1e-4


def test_the_same_rnkey_gives_the_same_run_and_another_one_another():
    def final(seed):
        model = TutorialMLP(rngs=nnx.Rngs(0))
        loop = nnx_loop(
            model, n_steps=10, n_steps_per_checkpoint=10, rnkey=jax.random.key(seed),
            collections={"apply": ["dropout"]},
        )  # fmt: skip
        return list(loop)[-1].model_params

    first, again, other = final(0), final(0), final(1)
    assert relative_difference(first, again) == 0.0
    assert relative_difference(first, other) > 1e-4


def test_several_steps_per_dispatch_match_single_steps():
    def final(steps_per_dispatch):
        model = CNN(rngs=nnx.Rngs(0))
        loop = nnx_loop(
            model, optax.sgd(0.1), n_steps=12, n_steps_per_checkpoint=6,
            steps_per_dispatch=steps_per_dispatch, data=ResumableBatches(X_TRAIN, Y_TRAIN, 32),
        )  # fmt: skip
        return list(loop)[-1]

    one, four = final(1), final(4)
    # Convolution biases before BatchNorm get no gradient: near-zero leaves,
    # compared with an absolute tolerance.
    assert_close(one.model_params, four.model_params, rtol=1e-5, atol=1e-6)
    assert_close(one.model_state, four.model_state, rtol=1e-5, atol=1e-6)


def test_files_resume_from_the_module_and_start_from_it_when_empty(tmp_path):
    model = PlainMLP(rngs=nnx.Rngs(0))
    reader = CheckpointFileReader(dir=str(tmp_path), target=model)
    fresh = nnx_loop(model, init=reader, n_steps=10, n_steps_per_checkpoint=5)
    assert fresh.step == 0
    writer = CheckpointFileWriter(output_dir=str(tmp_path))
    last = [writer(checkpoint) for checkpoint in fresh][-1]
    writer.close()
    resumed = nnx_loop(model, init=reader, optimizer=optax.adamw(0.0), n_steps=11)
    assert resumed.step == 10
    np.testing.assert_array_equal(
        resumed.next_step().model_params["linear1"]["kernel"],
        np.asarray(last.model_params["linear1"]["kernel"]),
    )


@slow(
    "by default an NNX run resumes from its file bitwise in this process "
    "(tests/test_frozen_files.py), and a linen run in a new process "
    "(tests/test_checkpoint_files.py)"
)
def test_resume_in_a_new_process_is_bitwise_exact(tmp_path):
    import os
    import shutil

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    options = ["--nnx", "--devices", 2, "--keep", 2]
    run(resume_worker(straight, 20, *options, "--out", tmp_path / "a.npz"))
    shutil.copytree(straight, resumed)  # the step-10 file, as a run stopped there left it
    os.remove(resumed / "regular.20.ckpt")
    out = run(resume_worker(resumed, 20, *options, "--out", tmp_path / "b.npz"))
    assert "START 10" in out
    assert_same_arrays(tmp_path / "a.npz", tmp_path / "b.npz")


def test_a_call_that_requires_a_train_keyword_is_a_config_error_saying_how_modes_are_set():
    from flax import nnx

    from flax_loop.errors import ConfigError

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(64, 10, rngs=rngs)
            self.dropout = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x, *, train):
            return self.dropout(self.linear(x), deterministic=not train)

    with pytest.raises(
        ConfigError, match=r"Net.__call__ requires the argument 'train'.*module\.train\(\)"
    ):
        nnx_loop(Net(nnx.Rngs(0)), n_steps=2)


def test_a_call_that_takes_the_mode_as_a_positional_argument_is_named():
    """The NNX tutorials' `__call__(self, x, train)`: a ConfigError naming the
    argument and how flax_loop sets the mode, not a bare TypeError."""

    class Tutorial(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(64, 10, rngs=nnx.Rngs(0))
            self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

        def __call__(self, x, train):
            return self.dropout(self.linear(x), deterministic=not train)

    from flax_loop.errors import ConfigError

    with pytest.raises(ConfigError, match=r"requires the argument 'train'.*module\.train\(\)"):
        nnx_loop(Tutorial(), n_steps=2)
