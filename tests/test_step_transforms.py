"""The step's transforms as plain JAX: no loop, no devices, numbers against
references written out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_loop.errors import ApplyError, ConfigError
from flax_loop.programs.state import TrainState
from flax_loop.programs.statistics import counted
from flax_loop.step import CORE, Context, Field, Outcome, Step, chain
from flax_loop.step.core import declare
from flax_loop.step.ema import with_ema
from flax_loop.step.nonfinite import skip_nonfinite
from flax_loop.step.objective import Objective, Part
from flax_loop.step.parts import parts_step
from flax_loop.step.supervised import supervised_loss
from tests.helpers import MLP, cross_entropy, digits_split

X, Y, _, _ = digits_split()
BATCH = ((X[:32],), (Y[:32],))
MODEL = MLP(features=(16,))
PARAMS = MODEL.init(jax.random.key(0), X[:1])["params"]
CONTEXT = Context(jax.random.key(0), jnp.int32(0))


def core(optimizer):
    return {"model_params": PARAMS, "model_state": {}, "optimizer_state": optimizer.init(PARAMS)}


def supervised(optimizer, trainable=None):
    part = Part(None, supervised_loss(cross_entropy), optimizer, trainable)
    return parts_step(Objective([part], MODEL.apply, [], False, supervised=True), None)


def reference_sgd(params, lr):
    def loss(params):
        return cross_entropy(MODEL.apply({"params": params}, X[:32]), Y[:32])

    value, grads = jax.value_and_grad(loss)(params)
    return value, grads, jax.tree.map(lambda p, g: p - lr * g, params, grads)


def close(a, b, rtol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-7), a, b)


def test_the_parts_step_is_one_sgd_step():
    step = supervised(optax.sgd(0.1))
    fields, outcome = jax.jit(step.update)(step.init(core(optax.sgd(0.1))), BATCH, CONTEXT)
    loss, grads, params = reference_sgd(PARAMS, 0.1)
    assert float(outcome.loss) == pytest.approx(float(loss), rel=1e-6)
    close(outcome.grads, grads)
    close(fields["model_params"], params)
    assert sorted(fields) == sorted(CORE) and bool(outcome.finite)


def test_a_trainable_subset_leaves_the_rest_and_has_no_gradient():
    only_last = lambda path, leaf: path[0] == "Dense_1"  # noqa: E731
    step = supervised(optax.sgd(0.1), only_last)
    fields = step.init(core(optax.sgd(0.1)))
    fields, outcome = jax.jit(step.update)(fields, BATCH, CONTEXT)
    _, grads, params = reference_sgd(PARAMS, 0.1)
    close(fields["model_params"]["Dense_1"], params["Dense_1"])
    same = jax.tree.map(np.array_equal, fields["model_params"]["Dense_0"], PARAMS["Dense_0"])
    assert all(jax.tree.leaves(same))
    assert outcome.grads["Dense_0"] == {"bias": None, "kernel": None}


def test_the_moving_average_moves_towards_the_parameters():
    step = with_ema(0.9)(supervised(optax.sgd(0.1)))
    fields = step.init(core(optax.sgd(0.1)))
    assert step.fields == {"ema_params": Field(mirrors_params=True)}
    fields, _ = jax.jit(step.update)(fields, BATCH, CONTEXT)
    _, _, params = reference_sgd(PARAMS, 0.1)
    close(fields["ema_params"], jax.tree.map(lambda a, p: 0.9 * a + 0.1 * p, PARAMS, params))


def test_a_frozen_parameters_average_is_the_parameter_bit_for_bit():
    frozen = lambda params: {  # noqa: E731
        layer: {name: layer == "Dense_0" for name in leaves} for layer, leaves in params.items()
    }
    step = with_ema(0.5, frozen)(supervised(optax.sgd(0.1)))
    fields, _ = jax.jit(step.update)(step.init(core(optax.sgd(0.1))), BATCH, CONTEXT)
    ema, params = fields["ema_params"], fields["model_params"]
    same = jax.tree.map(np.array_equal, ema["Dense_0"], params["Dense_0"])
    assert all(jax.tree.leaves(same))  # the parameter itself, not an average
    close(
        ema["Dense_1"],
        jax.tree.map(lambda a, p: 0.5 * a + 0.5 * p, PARAMS["Dense_1"], params["Dense_1"]),
    )


def test_skipping_keeps_every_field_a_transform_declared():
    def nan_loss(logits, labels):
        return cross_entropy(logits, labels) * jnp.nan

    part = Part(None, supervised_loss(nan_loss), optax.adam(0.1), None)
    base = parts_step(Objective([part], MODEL.apply, [], False, supervised=True), None)
    step = chain(base, with_ema(0.9), skip_nonfinite())
    fields = step.init(core(optax.adam(0.1)))
    new, outcome = jax.jit(step.update)(fields, BATCH, CONTEXT)
    assert not bool(outcome.finite)
    jax.tree.map(np.testing.assert_array_equal, new, fields)


def test_a_finite_loss_with_a_nonfinite_gradient_is_skipped():
    def update(fields, batch, context):
        new = {**fields, "model_params": {"w": jnp.zeros(2)}}
        return new, Outcome(jnp.float32(1), {}, {"w": jnp.array([1.0, jnp.inf])}, jnp.asarray(True))

    step = skip_nonfinite()(Step(dict, update))
    new, outcome = step.update({"model_params": {"w": jnp.ones(2)}}, None, CONTEXT)
    assert new["model_params"]["w"].tolist() == [1.0, 1.0] and not bool(outcome.finite)


def test_counting_sums_finite_steps_and_marks_the_first_bad_one():
    def update(fields, loss, context):  # the batch is the step's loss
        return fields, Outcome(loss, {"m": 2 * loss}, {}, jnp.isfinite(loss))

    run = counted(Step(dict, update))
    state = TrainState.create({"model_params": {}}, step=10)
    for loss in (1.0, jnp.nan, 3.0):
        state, _ = run(state, jnp.float32(loss), jax.random.key(0))
    assert state.counters.tolist() == [13, 1, 12]
    assert float(state.loss_sum) == 4.0 and float(state.metric_sums["m"]) == 8.0


def test_a_step_that_changes_a_fields_dtype_is_refused_while_tracing():
    def update(fields, batch, context):
        scale = fields["loss_scale"].astype(jnp.float16)
        return {**fields, "loss_scale": scale}, Outcome(jnp.float32(0), {}, {}, jnp.asarray(True))

    state = TrainState.create({"loss_scale": jnp.float32(2)}, step=0)
    with pytest.raises(ApplyError, match=r"dtype or shape of loss_scale .*float32\[\] -> float16"):
        counted(Step(dict, update))(state, None, jax.random.key(0))


def test_a_field_is_declared_once():
    step = with_ema(0.9)(supervised(optax.sgd(0.1)))
    with pytest.raises(ConfigError, match="already carries a field named 'ema_params'"):
        with_ema(0.5)(step)
    with pytest.raises(ConfigError, match="'model_params'"):
        declare(step, "model_params", Field())
