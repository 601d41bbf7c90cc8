"""Each built-in form of the step, run as plain JAX (no loop, no devices):
`gradient_step` (a `compute_loss`; a supervised `loss`), `in_turn` (parts
run in turn), `train_only` (a trainable subset), `with_frozen` (frozen
models) and `with_carry` (arrays a loss carries), each against the same
update written out by hand (to float rounding: the two are compiled as
different programs, which XLA may fuse differently)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flax_loop.data.batch import BatchTree
from flax_loop.errors import ConfigError, LossError
from flax_loop.random import loss_key
from flax_loop.step import Context, Outcome, Step
from flax_loop.step.carry import CARRY, split_carry, with_carry
from flax_loop.step.frozen import FrozenModels, with_frozen
from flax_loop.step.gradient import gradient_step
from flax_loop.step.objective import Objective, Part
from flax_loop.step.parts import in_turn
from flax_loop.step.supervised import supervised_loss
from flax_loop.step.trainable import Partition, train_only
from tests.helpers import MLP, cross_entropy, digits_split

X, Y, _, _ = digits_split()
MODEL = MLP(features=(16,))
PARAMS = MODEL.init(jax.random.key(0), X[:1])["params"]
KEY = jax.random.key(7)
CONTEXT = Context(KEY, jnp.int32(4))


def equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


def core(optimizer, params=PARAMS):
    return {"model_params": params, "model_state": {}, "optimizer_state": optimizer.init(params)}


def by_hand(loss_of, optimizer, params=PARAMS):
    """One update as a user writes it: value_and_grad, then the optimizer."""
    value, grads = jax.value_and_grad(loss_of)(params)
    updates, state = optimizer.update(grads, optimizer.init(params), params)
    return value, grads, optax.apply_updates(params, updates), state


def compute_loss_objective(compute_loss, optimizer, **keywords):
    tree = BatchTree()
    tree({"x": X[:32], "y": Y[:32]})  # the feed learns the batches' structure so
    part = Part(None, compute_loss, optimizer, keywords.pop("trainable", None))
    return Objective([part], MODEL.apply, [], False, batch_tree=tree, **keywords), tree


def test_a_compute_loss_step_is_the_hand_written_update():
    def compute_loss(model, batch, *, rng, step):
        loss = cross_entropy(model(batch["x"]), batch["y"])
        return loss, {"twice": 2 * loss, "step": step, "draw": jax.random.uniform(rng)}

    objective, tree = compute_loss_objective(compute_loss, optax.adam(1e-2))
    step = gradient_step(objective, 0, axis_name=None)
    batch = tree({"x": X[:32], "y": Y[:32]})
    fields, outcome = jax.jit(step.update)(core(optax.adam(1e-2)), batch, CONTEXT)

    def loss_of(params):
        return cross_entropy(MODEL.apply({"params": params}, X[:32]), Y[:32])

    value, grads, params, state = jax.jit(lambda: by_hand(loss_of, optax.adam(1e-2)))()
    close((outcome.loss, outcome.grads, fields["model_params"]), (value, grads, params))
    close(fields["optimizer_state"], state)
    assert float(outcome.metrics["twice"]) == pytest.approx(2 * float(value))
    # the loss's step is the updates done before; its key the step's (counted from 1)
    assert int(outcome.metrics["step"]) == 4
    assert outcome.metrics["draw"] == jax.random.uniform(loss_key(KEY, 5, 0))


def test_a_metric_named_loss_is_refused_rather_than_hiding_the_loss():
    """The training metrics' 'loss' (or '<part>_loss') is the loss itself: a
    metric of that name would replace it, silently."""

    def compute_loss(model, batch, *, rng, step):
        loss = cross_entropy(model(batch["x"]), batch["y"])
        return -loss, {"loss": loss}

    objective, tree = compute_loss_objective(compute_loss, optax.sgd(0.1))
    step = gradient_step(objective, 0, axis_name=None)
    with pytest.raises(LossError, match="metrics name one 'loss'.*such as 'raw_loss'"):
        jax.jit(step.update)(core(optax.sgd(0.1)), tree({"x": X[:32], "y": Y[:32]}), CONTEXT)


def test_a_supervised_loss_is_the_same_step_of_the_models_outputs():
    objective = Objective(
        [Part(None, supervised_loss(cross_entropy), optax.sgd(0.1), None)],
        MODEL.apply,
        [],
        False,
        supervised=True,
    )
    step = gradient_step(objective, 0, axis_name=None)
    fields, outcome = jax.jit(step.update)(core(optax.sgd(0.1)), ((X[:32],), (Y[:32],)), CONTEXT)

    def loss_of(params):
        return cross_entropy(MODEL.apply({"params": params}, X[:32]), Y[:32])

    value, grads, params, _ = jax.jit(lambda: by_hand(loss_of, optax.sgd(0.1)))()
    close((outcome.loss, outcome.grads, fields["model_params"]), (value, grads, params))
    assert bool(outcome.finite) and fields["model_state"] == {}


def sgd_step(lr, weight=1.0):
    """A plain step of one parameter vector: loss weight * |whole(w)|^2 / 2."""

    def update(fields, batch, context):
        whole = context.whole or (lambda params: params)

        def loss_of(params):
            return weight * sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(whole(params))) / 2

        loss, grads = jax.value_and_grad(loss_of)(fields["model_params"])
        params = jax.tree.map(lambda p, g: p - lr * g, fields["model_params"], grads)
        count = fields["optimizer_state"] + 1
        new = {**fields, "model_params": params, "optimizer_state": count}
        return new, Outcome(loss, {"lr": jnp.float32(lr)}, grads, jnp.isfinite(loss))

    return Step(dict, update)


def test_parts_in_turn_each_see_what_the_one_before_updated():
    step = in_turn([("first", sgd_step(0.5)), ("second", sgd_step(0.25, weight=2.0))])
    w = jnp.array([1.0, -2.0])
    fields = step.init(
        {"model_params": w, "model_state": {}, "optimizer_state": {"first": 0, "second": 10}}
    )
    fields, outcome = jax.jit(step.update)(fields, None, CONTEXT)
    after_first = w - 0.5 * w  # [0.5, -1]
    after_second = after_first - 0.25 * 2 * after_first
    equal(fields["model_params"], after_second)
    assert fields["optimizer_state"] == {"first": 1, "second": 11}
    first_loss, second_loss = float(jnp.sum(w**2) / 2), float(jnp.sum(after_first**2))
    assert float(outcome.loss) == pytest.approx(first_loss + second_loss)
    assert sorted(outcome.metrics) == ["first_loss", "first_lr", "second_loss", "second_lr"]
    equal(outcome.grads["second"], 2 * after_first)


def test_a_trainable_subset_is_all_the_step_sees_and_the_rest_stays_bit_for_bit():
    params = {"frozen": jnp.array([3.0, 4.0]), "trained": jnp.array([1.0, -1.0])}
    partition = Partition.of("trained", params)
    step = train_only(lambda given: partition)(sgd_step(0.5))
    fields = {"model_params": params, "model_state": {}, "optimizer_state": 0}
    fields, outcome = jax.jit(step.update)(fields, None, CONTEXT)
    equal(fields["model_params"]["frozen"], params["frozen"])
    equal(fields["model_params"]["trained"], 0.5 * params["trained"])
    assert outcome.grads["frozen"] is None  # no gradient, no optimizer state
    # the loss saw every parameter (`Context.whole`)
    assert float(outcome.loss) == pytest.approx((9 + 16 + 1 + 1) / 2)


def test_the_frozen_models_are_the_models_inside_the_step():
    class Teacher(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(64, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.dense(x))

    teacher = Teacher(nnx.Rngs(0))
    table = {"w": jnp.float32(2)}
    models = FrozenModels.of({"teacher": teacher, "table": table})

    def update(fields, batch, context):
        out = context.frozen["teacher"](batch) * context.frozen["table"]["w"]
        return fields, Outcome(jnp.sum(out), {}, {}, jnp.asarray(True))

    step = with_frozen(models)(Step(dict, update))
    _, outcome = jax.jit(step.update)({}, X[:4], Context(KEY, 0, models.arrays()))
    # evaluation mode: the dropout is off, so the output is the layer's, doubled
    expected = 2 * jnp.sum(teacher.dense(X[:4]))
    assert float(outcome.loss) == pytest.approx(float(expected), rel=1e-6)
    assert FrozenModels.of(None) is None and list(FrozenModels.of(teacher).models) == ["frozen"]


def test_a_carry_starts_from_the_parameters_and_is_declared_once():
    def update(fields, batch, context):
        target = jax.tree.map(lambda t, p: 0.5 * t + 0.5 * p, fields[CARRY], fields["model_params"])
        params = jax.tree.map(lambda p: p + 1, fields["model_params"])
        new = {**fields, "model_params": params, CARRY: target}
        return new, Outcome(jnp.float32(0), {}, {}, jnp.asarray(True))

    step = with_carry(lambda params: params)(Step(dict, update))
    fields = step.init(
        {"model_params": {"w": jnp.ones(2)}, "model_state": {}, "optimizer_state": ()}
    )
    assert fields[CARRY]["w"] is not fields["model_params"]["w"]  # a copy
    for _ in range(2):
        fields, _ = jax.jit(step.update)(fields, None, CONTEXT)
    equal(fields[CARRY]["w"], jnp.full(2, 1.5))  # 0.5 * 1 + 0.5 * 1, then 0.5 * 1 + 0.5 * 2
    with pytest.raises(ConfigError, match="already carries a field named 'carry'"):
        with_carry({})(step)
    assert split_carry((1, {}, 2), None) == ((1, {}), 2)
    with pytest.raises(LossError, match=r"task.compute_loss\['critic'\] returns .* a tuple of 2"):
        split_carry((1, {}), "critic")


def test_a_linen_compute_loss_may_not_train_an_integer_parameter():
    class Counter(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.param("count", lambda key: jnp.zeros((), jnp.int32))
            return nn.Dense(3)(x)

    model = Counter()
    params = model.init(jax.random.key(0), X[:1])["params"]
    objective = Objective(
        [Part(None, supervised_loss(cross_entropy), optax.sgd(0.1), None)],
        model.apply,
        [],
        False,
        supervised=True,
    )
    step = gradient_step(objective, 0, axis_name=None)
    fields = core(optax.sgd(0.1), params)
    with pytest.raises(ConfigError, match="The parameter count is int32"):
        jax.jit(step.update)(fields, ((X[:4],), (Y[:4],)), CONTEXT)


def test_a_typed_key_in_the_carry_is_refused_naming_the_leaf_and_the_fix():
    """A checkpoint file holds numbers: a typed key would fail at the first
    write, after training; refused when the carry starts, with the fix."""
    step = with_carry({"noise": {"key": jax.random.key(3)}, "seen": jnp.int32(0)})(
        Step(dict, lambda fields, batch, context: (fields, None))
    )
    with pytest.raises(ConfigError, match=r"carry\['noise'\]\['key'\] is a typed key.*key_data"):
        step.init({"model_params": {}, "model_state": {}, "optimizer_state": ()})
    data = with_carry({"key": jax.random.key_data(jax.random.key(3))})(
        Step(dict, lambda fields, batch, context: (fields, None))
    )
    started = data.init({"model_params": {}, "model_state": {}, "optimizer_state": ()})
    assert started[CARRY]["key"].dtype == jnp.uint32
