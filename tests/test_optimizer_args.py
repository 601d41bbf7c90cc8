"""Optimizers that read more than the gradients: optax's extra arguments.

`optax.contrib.reduce_on_plateau` and `optax.polyak_sgd` read the loss
(`value=`), `optax.lbfgs` also the gradient and the loss as a function of
the parameters (`grad=`, `value_fn=`). The built-in steps give them; an own
step passes them, and any other (Sophia's `obj_fn=`), to
`state.apply_gradients`. Each run is compared with a hand-written `jax.jit`
loop that calls the optimizer as optax documents it.
"""

import itertools

import flax.linen as nn
import jax
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
from flax_loop.errors import ConfigError
from tests.helpers import (
    MLP,
    assert_close,
    batches,
    cross_entropy,
    digits_split,
    relative_difference,
)

X, Y, _, _ = digits_split()
DATA = list(itertools.islice(batches(X, Y, 32), 12))
N_STEPS = 24


def from_key_0(rngs, x, **options):
    """The model's parameters from key 0, as the hand-written loops start."""
    return MLP().init(jax.random.key(0), x, **options)


def hand_written(optimizer, n_steps=N_STEPS, data=DATA, extra=("value", "grad", "value_fn")):
    """The parameters and the optimizer state after `n_steps` of a jitted
    step that gives the optimizer the loss, the gradient and the loss as a
    function of the parameters (optax's documented calls; those named in
    `extra`, where `obj_fn` is the loss function too)."""
    model = MLP()

    @jax.jit
    def step(params, state, inputs, labels):
        def loss_of(params):
            return cross_entropy(model.apply({"params": params}, inputs), labels)

        loss, grads = jax.value_and_grad(loss_of)(params)
        offered = {"value": loss, "grad": grads, "value_fn": loss_of, "obj_fn": loss_of}
        given = {name: offered[name] for name in extra}
        updates, state = optimizer.update(grads, state, params, **given)
        return optax.apply_updates(params, updates), state

    params = model.init(jax.random.key(0), X[:1])["params"]
    state = optimizer.init(params)
    for inputs, labels in itertools.islice(itertools.cycle(data), n_steps):
        params, state = step(params, state, inputs, labels)
    return params, state


def trained(optimizer, n_devices=1, update=None, n_steps=N_STEPS, data=DATA, model=None, **options):
    options.setdefault("init", from_key_0 if model is None else model.init)
    loop = TrainLoop(
        task=TrainTask(
            (model or MLP()).apply,
            optimizer,
            None if update else cross_entropy,
            data,
            update=update,
        ),
        rnkey=jax.random.key(0),
        n_steps=n_steps,
        n_steps_per_checkpoint=n_steps // 3,
        devices=jax.devices()[:n_devices],
        stdout=False,
        **options,
    )
    return list(loop)[-1]


def plateau(optimizer=None):
    # the mean loss of 4 steps is one value; one not 30% below the best: half the rate
    return optax.chain(
        optimizer or optax.adam(1e-2),
        optax.contrib.reduce_on_plateau(patience=1, factor=0.5, rtol=0.3, accumulation_size=4),
    )


def scale_of(state):
    return float(state[1].scale)


def test_reduce_on_plateau_is_given_the_steps_loss():
    expected_params, expected_state = hand_written(plateau())
    checkpoint = trained(plateau())
    assert scale_of(expected_state) < 1.0  # the data lowered the rate: the test can tell
    assert scale_of(checkpoint.optimizer_state) == scale_of(expected_state)
    assert relative_difference(checkpoint.model_params, expected_params) < 1e-5
    # one device or four: the same global step
    on_four = trained(plateau(), n_devices=4)
    assert scale_of(on_four.optimizer_state) == scale_of(expected_state)
    assert relative_difference(on_four.model_params, expected_params) < 1e-5


def test_reduce_on_plateau_resumes_bit_for_bit(tmp_path):
    # its state (the best loss, the losses accumulated, the scale) is in the file
    straight = trained(plateau(), n_devices=2)
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        write(trained(plateau(), n_devices=2, n_steps=N_STEPS // 2))
    reader = CheckpointFileReader(dir=str(tmp_path), target=from_key_0)
    resumed = trained(plateau(), n_devices=2, init=reader)
    assert resumed.step == N_STEPS
    assert scale_of(resumed.optimizer_state) == scale_of(straight.optimizer_state) < 1.0
    jax.tree.map(np.testing.assert_array_equal, resumed.model_params, straight.model_params)


def test_lbfgs_runs_its_line_search_on_the_steps_batch():
    data = [(X[:256], Y[:256])]  # one batch: L-BFGS's full-batch use
    expected, _ = hand_written(optax.lbfgs(), n_steps=15, data=data)
    checkpoint = trained(optax.lbfgs(), n_steps=15, data=data)
    assert relative_difference(checkpoint.model_params, expected) < 1e-4
    first = cross_entropy(MLP().apply(from_key_0(None, X[:1]), X[:256]), Y[:256])
    assert float(checkpoint.loss) < 0.2 * float(first)
    # the parameters split over four devices: the search is one program's
    sharded = trained(
        optax.lbfgs(), n_devices=4, n_steps=15, data=data, sharding="fsdp", fsdp_min_bytes=1024
    )
    assert relative_difference(sharded.model_params, expected) < 1e-4


def test_polyak_sgd_steps_by_the_loss():
    # Polyak's step size is the loss over the gradient's squared norm
    optimizer = optax.polyak_sgd(max_learning_rate=0.5)
    expected, _ = hand_written(optimizer)
    checkpoint = trained(optimizer, n_devices=4)
    assert relative_difference(checkpoint.model_params, expected) < 1e-5


def own_step(*passed):
    """An own step that passes `state.apply_gradients` the extra arguments
    named: `value`, `grad`, `value_fn` or `obj_fn` (the loss function)."""

    def update(state, batch, *, rng, step):
        inputs, labels = batch

        def loss_of(params):
            return cross_entropy(state.model(params)(inputs), labels)

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        offered = {"value": loss, "grad": grads, "value_fn": loss_of, "obj_fn": loss_of}
        extra = {name: offered[name] for name in passed}
        return state.apply_gradients(grads, **extra), {"loss": loss}

    return update


def test_an_own_step_passes_them_to_apply_gradients():
    expected_params, expected_state = hand_written(plateau())
    checkpoint = trained(plateau(), update=own_step("value"))
    assert scale_of(checkpoint.optimizer_state) == scale_of(expected_state)
    assert relative_difference(checkpoint.model_params, expected_params) < 1e-5


def test_an_own_step_that_leaves_out_the_loss_is_told_to_pass_it():
    with pytest.raises(ConfigError, match=r"'value'.*apply_gradients\(grads, value=loss"):
        trained(plateau(), update=own_step())


def test_an_optimizer_that_reads_no_extra_arguments_is_called_as_before():
    # a plain GradientTransformation's update takes (updates, state, params) only
    sgd = optax.sgd(0.1)
    plain = optax.GradientTransformation(sgd.init, lambda g, s, p=None: sgd.update(g, s, p))
    assert not isinstance(plain, optax.GradientTransformationExtraArgs)
    expected, _ = hand_written(optax.sgd(0.1))
    checkpoint = trained(plain)
    jax.tree.map(np.testing.assert_array_equal, checkpoint.model_params, trained(sgd).model_params)
    assert relative_difference(checkpoint.model_params, expected) < 1e-5


class Normalized(nn.Module):
    """With `axis_name`, code of the per-device form: its BatchNorm averages
    over the devices, and the step runs per device."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(nn.Dense(32)(x))
        return nn.Dense(10)(nn.relu(x))


def test_a_step_written_per_device_gives_the_loss_averaged_over_the_devices():
    # SGD: Adam would scale up the rounding in the gradient of the bias
    # before the BatchNorm (0 but for rounding, so compared absolutely)
    per_device = trained(
        plateau(optax.sgd(0.1)), n_devices=2, model=Normalized(axis_name=DATA_AXIS)
    )
    whole = trained(plateau(optax.sgd(0.1)), model=Normalized())
    assert scale_of(whole.optimizer_state) < 1.0
    assert scale_of(per_device.optimizer_state) == scale_of(whole.optimizer_state)
    assert_close(per_device.model_params, whole.model_params, rtol=1e-5, atol=1e-6)


def test_a_line_search_in_a_step_written_per_device_is_refused_naming_why():
    # its gradient would be one device's: the devices' searches would part
    # and wait for each other's collectives for ever
    with pytest.raises(ConfigError, match=r"'value_fn'.*written per device.*one device's"):
        trained(optax.lbfgs(), n_devices=2, model=Normalized(axis_name=DATA_AXIS))


def test_the_hyperparameters_of_an_optimizer_that_reads_the_loss_are_found():
    # `loop.set_hyperparams` finds them by probing an update (with a loss)
    from flax_loop.run.hand import constant_hyperparams

    adam = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    found = constant_hyperparams(optax.chain(adam, optax.contrib.reduce_on_plateau()))
    assert float(found[0]["learning_rate"]) == np.float32(1e-2)


@pytest.mark.parametrize("chained", [False, True], ids=["alone", "chained"])
def test_a_transformation_that_takes_none_of_them_is_called_without_them(chained):
    # optax.contrib.sam declares extra arguments (GradientTransformationExtraArgs)
    # but takes only its own grad_fn, and in a chain optax passes it the chain's
    def sam():
        sam = optax.contrib.sam(optax.adam(1e-2), optax.sgd(1e-2), sync_period=2)
        return optax.chain(optax.clip_by_global_norm(1.0), sam) if chained else sam

    expected, _ = hand_written(sam(), extra=())
    checkpoint = trained(sam())
    assert relative_difference(checkpoint.model_params, expected) < 1e-5


def test_an_own_step_written_per_device_is_refused_a_line_search():
    model = Normalized(axis_name=DATA_AXIS)
    with pytest.raises(ConfigError, match=r"value_fn.*written per device.*one device's"):
        trained(optax.lbfgs(), n_devices=2, model=model, update=own_step("value", "value_fn"))


def sophia():
    return optax.contrib.sophia(1e-2, update_interval=2)


def test_an_optimizer_wanting_an_argument_the_steps_do_not_give_says_to_write_one():
    # Sophia estimates the Hessian from the loss function, which optax names obj_fn
    with pytest.raises(ConfigError, match=r"wants .*'obj_fn'.*your own step.*apply_gradients"):
        trained(sophia())


def test_an_own_step_gives_it_what_it_wants():
    expected, _ = hand_written(sophia(), extra=("obj_fn",))
    checkpoint = trained(sophia(), update=own_step("obj_fn"))
    assert relative_difference(checkpoint.model_params, expected) < 1e-5
