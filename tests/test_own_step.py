"""Your own step (`TrainTask(update=fn)`): several updates of an optimizer in
a step, arrays carried from step to step, the step counted from 0; each
program against the same algorithm written out in plain JAX, resumed,
at other cadences and on four devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_loop import CheckpointFileReader, CheckpointFileWriter, TrainLoop, TrainTask
from flax_loop.errors import ApplyError, ConfigError, LossError
from flax_loop.random import init_key, into_collection, loss_key, train_key
from tests.helpers import ResumableBatches

SEED = 0
POINTS = np.random.default_rng(0).normal(size=(640, 2)).astype(np.float32) * [1.0, 0.3] + [2, -1]
LABELS = np.zeros(len(POINTS), np.int32)  # unused: the stream's pairs carry them along


def the_rng(step, device=0):
    """The `rng` the loop gives a step (`step` counted from 0) on a device."""
    return loss_key(train_key(jax.random.key(SEED)), step + 1, device)


def initial(model, x):
    """The parameters the loop initializes a model with (its run key's init key)."""
    return model.init(into_collection(init_key(jax.random.key(SEED)), ["params"]), x)["params"]


def same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


# -- WGAN-GP: five critic updates on five sub-batches, one critic Adam ---------


class GAN(nn.Module):
    """A generator and a critic, as two methods of one module."""

    def setup(self):
        self.generator = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(2)])
        self.critic = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(1)])

    def __call__(self, z):
        return self.critic(self.generator(z))

    def generate(self, z):
        return self.generator(z)

    def judge(self, x):
        return self.critic(x)[:, 0]


GAN_MODEL = GAN()
N_CRITIC, SUB = 5, 16
OPTIMIZERS = {"critic": optax.adam(1e-3, b1=0.5), "generator": optax.adam(1e-3, b1=0.5)}
TRAINABLE = {
    "critic": lambda path, _: path[0] == "critic",
    "generator": lambda path, _: path[0] == "generator",
}


def critic_loss(apply, params, real, z, eps):
    fake = apply(params, z, method="generate")
    mixed = eps * real + (1 - eps) * fake

    def judged(x):
        return apply(params, x[None], method="judge")[0]

    slopes = jax.vmap(jax.grad(judged))(mixed)
    penalty = ((jnp.linalg.norm(slopes, axis=-1) - 1) ** 2).mean()
    return (
        apply(params, fake, method="judge").mean()
        - apply(params, real, method="judge").mean()
        + 10 * penalty
    )


def generator_loss(apply, params, z):
    return -apply(params, apply(params, z, method="generate"), method="judge").mean()


def wgan_draws(rng, i):
    key = jax.random.fold_in(rng, i)
    return jax.random.normal(key, (SUB, 4)), jax.random.uniform(
        jax.random.fold_in(key, 1), (SUB, 1)
    )


def wgan_update(state, batch, *, rng, step):
    real = batch[0].reshape(N_CRITIC, SUB, 2)

    def apply(params, *args, **kwargs):
        return state.model(params)(*args, **kwargs)

    for i in range(N_CRITIC):
        z, eps = wgan_draws(rng, i)
        loss_c, grads = jax.value_and_grad(lambda p: critic_loss(apply, p, real[i], z, eps))(
            state.params
        )
        state = state.apply_gradients(grads, "critic")
    z, _ = wgan_draws(rng, N_CRITIC)
    loss_g, grads = jax.value_and_grad(lambda p: generator_loss(apply, p, z))(state.params)
    state = state.apply_gradients(grads, "generator")
    return state, {"loss": loss_g, "critic_loss": loss_c}


def wgan_loop(n_steps, **options):
    options.setdefault("devices", jax.devices()[:1])
    options.setdefault("init", GAN_MODEL.init)
    return TrainLoop(
        task=TrainTask(
            GAN_MODEL.apply,
            OPTIMIZERS,
            data=ResumableBatches(POINTS, LABELS, N_CRITIC * SUB),
            update=wgan_update,
            trainable=TRAINABLE,
        ),
        rnkey=jax.random.key(SEED),
        n_steps=n_steps,
        input_sample=np.zeros((1, 4), np.float32),
        stdout=False,
        **options,
    )


def wgan_by_hand(n_steps):
    """The same algorithm in plain JAX: each Adam over its own model's part."""
    params = initial(GAN_MODEL, np.zeros((1, 4), np.float32))
    states = {name: OPTIMIZERS[name].init(params[name]) for name in OPTIMIZERS}

    def apply(params, *args, **kwargs):
        return GAN_MODEL.apply({"params": params}, *args, **kwargs)

    def adam_step(name, params, states, grads):
        updates, states[name] = OPTIMIZERS[name].update(grads[name], states[name], params[name])
        return {**params, name: optax.apply_updates(params[name], updates)}, states

    @jax.jit
    def step(params, states, real, rng):
        real = real.reshape(N_CRITIC, SUB, 2)
        for i in range(N_CRITIC):
            z, eps = wgan_draws(rng, i)
            grads = jax.grad(lambda p: critic_loss(apply, p, real[i], z, eps))(params)
            params, states = adam_step("critic", params, states, grads)
        z, _ = wgan_draws(rng, N_CRITIC)
        grads = jax.grad(lambda p: generator_loss(apply, p, z))(params)
        return adam_step("generator", params, states, grads)

    data = ResumableBatches(POINTS, LABELS, N_CRITIC * SUB)
    for number in range(n_steps):
        params, states = step(params, states, next(data)[0], the_rng(number))
    return params, states


@pytest.fixture(scope="module")
def wgan_straight():
    return list(wgan_loop(6, n_steps_per_checkpoint=3))


def test_five_critic_updates_with_one_adam_are_the_algorithm(wgan_straight):
    last = wgan_straight[-1]
    params, states = wgan_by_hand(6)
    np.testing.assert_array_equal(  # one Adam: its count advanced five a step
        last.optimizer_state["critic"][0].count, N_CRITIC * 6
    )
    assert int(last.optimizer_state["generator"][0].count) == 6
    for name in ("critic", "generator"):
        jax.tree.map(
            # the same algorithm, fused otherwise by XLA (7e-8 apart here)
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
            last.model_params[name],
            params[name],
        )
    assert set(last.train_metrics) >= {"loss", "critic_loss"}
    # the gradients each optimizer last applied, over what it trains
    assert last.grads["critic"]["generator"] == jax.tree.map(lambda _: None, params["generator"])


def test_the_wgan_step_resumes_and_keeps_its_bits_at_any_cadence(wgan_straight, tmp_path):
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        for checkpoint in wgan_loop(3, n_steps_per_checkpoint=3):
            write(checkpoint)
    reader = CheckpointFileReader(dir=str(tmp_path), target=GAN_MODEL.init)
    (resumed,) = list(wgan_loop(6, n_steps_per_checkpoint=3, init=reader))
    same(resumed.model_params, wgan_straight[-1].model_params)
    same(resumed.optimizer_state, wgan_straight[-1].optimizer_state)
    grouped = list(wgan_loop(6, n_steps_per_checkpoint=6, steps_per_dispatch=4))
    same(grouped[-1].model_params, wgan_straight[-1].model_params)


# -- dynamic loss scaling: a scale carried from step to step -------------------


class Regressor(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(32)(x)))[:, 0]


REGRESSOR = Regressor()
X = np.random.default_rng(1).normal(size=(512, 8)).astype(np.float32)
Y = (X[:, 0] * 3 - X[:, 1] + 0.1).astype(np.float32)
GROWTH_INTERVAL = 3
START = {"scale": jnp.float32(2.0**20), "good": jnp.int32(0), "seen": jnp.int32(-1)}


def scaled_update(params, scale, good, loss_and_grads, apply):
    """One loss-scaled update: gradients of the scaled loss cast to float16
    (as half-precision gradients are), unscaled when finite and applied; the
    scale halved after an overflow, doubled after `GROWTH_INTERVAL` good steps."""
    loss, grads = loss_and_grads(params, scale)
    half = jax.tree.map(lambda g: g.astype(jnp.float16), grads)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(half)]))
    unscaled = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, half)
    applied = apply(unscaled, finite)
    good = jnp.where(finite, good + 1, 0)
    grow = good >= GROWTH_INTERVAL
    scale = jnp.where(finite, jnp.where(grow, scale * 2, scale), scale / 2)
    return loss, applied, scale, jnp.where(grow, 0, good)


def scaling_update(state, batch, *, rng, step):
    x, y = batch

    def loss_and_grads(params, scale):
        def loss(p):
            return ((state.model(p)(x) - y) ** 2).mean()

        value, grads = jax.value_and_grad(lambda p: loss(p) * scale)(params)
        return value / scale, grads

    def apply(grads, finite):
        return jax.lax.cond(finite, lambda s: s.apply_gradients(grads), lambda s: s, state)

    loss, state, scale, good = scaled_update(
        state.params, state.carry["scale"], state.carry["good"], loss_and_grads, apply
    )
    carry = {"scale": scale, "good": good, "seen": step}
    return state.replace(carry=carry), {"loss": loss, "scale": scale}


def scaling_loop(n_steps, optimizer=None, **options):
    options.setdefault("devices", jax.devices()[:1])
    options.setdefault("init", REGRESSOR.init)
    return TrainLoop(
        task=TrainTask(
            REGRESSOR.apply,
            optimizer or optax.adam(1e-2),
            data=ResumableBatches(X, Y, 32),
            update=scaling_update,
            carry=START,
        ),
        rnkey=jax.random.key(SEED),
        n_steps=n_steps,
        stdout=False,
        **options,
    )


def scaling_by_hand(n_steps, optimizer):
    params = initial(REGRESSOR, X[:32])
    state = optimizer.init(params)
    scale, good = START["scale"], START["good"]

    @jax.jit
    def step(params, state, scale, good, x, y):
        def loss_and_grads(params, scale):
            def loss(p):
                return ((REGRESSOR.apply({"params": p}, x) - y) ** 2).mean()

            value, grads = jax.value_and_grad(lambda p: loss(p) * scale)(params)
            return value / scale, grads

        def apply(grads, finite):
            def applied(pair):
                params, state = pair
                updates, state = optimizer.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            return jax.lax.cond(finite, applied, lambda pair: pair, (params, state))

        _, (params, state), scale, good = scaled_update(params, scale, good, loss_and_grads, apply)
        return params, state, scale, good

    data = ResumableBatches(X, Y, 32)
    scales = []
    for _ in range(n_steps):
        params, state, scale, good = step(params, state, scale, good, *next(data))
        scales.append(float(scale))
    return params, scale, good, scales


@pytest.fixture(scope="module")
def scaling_straight():
    return list(scaling_loop(14, n_steps_per_checkpoint=7))


def test_a_loss_scale_carried_between_steps_is_the_algorithm(scaling_straight):
    last = scaling_straight[-1]
    params, scale, good, scales = scaling_by_hand(14, optax.adam(1e-2))
    assert min(scales) < 2.0**20 / 8 and len(set(scales)) > 3  # it overflowed, and grew again
    np.testing.assert_array_equal(last.carried["carry"]["scale"], scale)
    np.testing.assert_array_equal(last.carried["carry"]["good"], good)
    same(last.model_params, params)  # the same computation: the same bits


def test_the_step_counts_from_zero(scaling_straight):
    first, last = scaling_straight
    assert (first.step, int(first.carried["carry"]["seen"])) == (7, 6)
    assert (last.step, int(last.carried["carry"]["seen"])) == (14, 13)


def test_the_carry_resumes_bit_for_bit_at_any_cadence(scaling_straight, tmp_path):
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        for checkpoint in scaling_loop(7, n_steps_per_checkpoint=7):
            write(checkpoint)
    reader = CheckpointFileReader(dir=str(tmp_path), target=REGRESSOR.init)
    (resumed,) = list(scaling_loop(14, n_steps_per_checkpoint=7, init=reader))
    for other in (resumed, list(scaling_loop(14, n_steps_per_checkpoint=1))[-1]):
        same(other.carried, scaling_straight[-1].carried)
        same(other.model_params, scaling_straight[-1].model_params)
    grouped = list(scaling_loop(14, n_steps_per_checkpoint=7, steps_per_dispatch=4))
    same(grouped[-1].carried, scaling_straight[-1].carried)
    same(grouped[-1].model_params, scaling_straight[-1].model_params)


def test_four_devices_compute_what_one_computes():
    one = list(scaling_loop(6, optax.sgd(0.05), n_steps_per_checkpoint=6))[-1]
    four = list(
        scaling_loop(6, optax.sgd(0.05), n_steps_per_checkpoint=6, devices=jax.devices()[:4])
    )[-1]
    same(four.carried, one.carried)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        four.model_params,
        one.model_params,
    )


# -- bad input ----------------------------------------------------------------


def plain_update(state, batch, *, rng, step):
    x, y = batch
    loss, grads = jax.value_and_grad(lambda p: ((state.model(p)(x) - y) ** 2).mean())(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def loop_of(update, **task):
    return TrainLoop(
        init=REGRESSOR.init,
        task=TrainTask(
            REGRESSOR.apply, optax.sgd(0.1), data=ResumableBatches(X, Y, 32), update=update, **task
        ),
        rnkey=jax.random.key(0),
        n_steps=2,
        devices=jax.devices()[:1],
        stdout=False,
    )


def test_an_update_returning_something_else_is_named():
    def returns_metrics_only(state, batch, *, rng, step):
        return {"loss": jnp.float32(0)}

    with pytest.raises(ConfigError, match=r"must return \(state, metrics\).*returned dict"):
        loop_of(returns_metrics_only)


def test_metrics_without_a_loss_are_named():
    def no_loss(state, batch, *, rng, step):
        return plain_update(state, batch, rng=rng, step=step)[0], {"mse": jnp.float32(0)}

    with pytest.raises(LossError, match="with 'loss'"):
        loop_of(no_loss)


def test_a_carry_whose_dtype_the_step_changes_is_named():
    def widens(state, batch, *, rng, step):
        state, metrics = plain_update(state, batch, rng=rng, step=step)
        return state.replace(carry={"n": state.carry["n"].astype(jnp.float32)}), metrics

    with pytest.raises(ApplyError, match=r"carry .*int32\[\] -> float32\[\]"):
        loop_of(widens, carry={"n": jnp.int32(0)})


def test_an_unknown_optimizer_name_is_named():
    def wrong_name(state, batch, *, rng, step):
        x, y = batch
        grads = jax.grad(lambda p: ((state.model(p)(x) - y) ** 2).mean())(state.params)
        return state.apply_gradients(grads, "critic"), {"loss": jnp.float32(0)}

    with pytest.raises(ConfigError, match="no optimizer of that name"):
        loop_of(wrong_name)


def test_gradients_not_shaped_as_the_parameters_are_named():
    """A sub-tree of the gradients, or a gradient of another (broadcastable)
    shape, is refused naming apply_gradients, the paths and the shapes."""

    def grads_of(state, batch):
        x, y = batch
        return jax.grad(lambda p: ((state.model(p)(x) - y) ** 2).mean())(state.params)

    def subtree(state, batch, *, rng, step):
        grads = grads_of(state, batch)
        return state.apply_gradients({"Dense_0": grads["Dense_0"]}), {"loss": jnp.float32(0)}

    def broadcast(state, batch, *, rng, step):
        grads = grads_of(state, batch)
        bias = grads["Dense_1"]["bias"]
        grads["Dense_1"]["bias"] = bias.sum(keepdims=True) if bias.shape != (1,) else bias[0]
        return state.apply_gradients(grads), {"loss": jnp.float32(0)}

    with pytest.raises(ConfigError, match=r"state.apply_gradients: .*missing \['Dense_1/bias'"):
        loop_of(subtree)
    with pytest.raises(ConfigError, match=r"gradient of Dense_1/bias has the shape"):
        loop_of(broadcast)


def test_an_update_given_with_a_loss_or_a_carry_without_one_is_refused():
    with pytest.raises(ConfigError, match="task has both loss and update"):
        TrainLoop(
            init=REGRESSOR.init,
            task=TrainTask(
                REGRESSOR.apply, optax.sgd(0.1), lambda o, y: o, [(X, Y)], update=plain_update
            ),
            rnkey=jax.random.key(0),
        )
    with pytest.raises(ConfigError, match="task.carry is carried by a step that reads it"):
        TrainLoop(
            init=REGRESSOR.init,
            task=TrainTask(
                REGRESSOR.apply, optax.sgd(0.1), lambda o, y: o, [(X, Y)], carry={"n": 0}
            ),
            rnkey=jax.random.key(0),
        )
    with pytest.raises(ConfigError, match="missing step"):
        loop_of(lambda state, batch, *, rng: None)


# -- writes inside an NNX loss ------------------------------------------------


def test_a_parameter_written_in_the_loss_is_named_and_a_variable_carries_over():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(8, 1, rngs=rngs)
            self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.calls[...] = self.calls[...] + 1
            return self.linear(x)[:, 0]

    def squared_error(model, batch, *, rng, step):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def nudges_the_bias(model, batch, *, rng, step):
        model.linear.bias[...] = model.linear.bias[...] + 1.0
        return squared_error(model, batch, rng=rng, step=step)

    def loop(net, compute_loss):
        return TrainLoop(
            init=net,
            task=TrainTask(
                net, optax.sgd(0.1), data=ResumableBatches(X, Y, 32), compute_loss=compute_loss
            ),
            rnkey=jax.random.key(0),
            n_steps=3,
            devices=jax.devices()[:1],
            stdout=False,
        )

    net = Net(nnx.Rngs(0))
    with pytest.raises(
        ApplyError, match=r"assigned new values to trained parameters \(linear/bias\)"
    ):
        loop(net, nudges_the_bias)
    last = list(loop(net, squared_error))[-1]
    assert int(last.model_state["calls"]) == 3  # a non-parameter variable carries over


# -- a step that reads no data: the samples drawn in the step ------------------


class Mean(nn.Module):
    @nn.compact
    def __call__(self, x):  # x: (n, 1) ones, one row a sample
        return self.param("mu", nn.initializers.zeros, (2,)) * x


def sampled_update(state, batch, *, rng, step):
    assert batch is None  # no stream: the step draws its own samples
    samples = jax.random.normal(rng, (64, 2)) + jnp.asarray([3.0, -1.0])
    ones = jnp.ones((64, 1))
    loss, grads = jax.value_and_grad(lambda p: ((state.model(p)(ones) - samples) ** 2).mean())(
        state.params
    )
    return state.apply_gradients(grads), {"loss": loss}


def sampled_loop(**options):
    return TrainLoop(
        init=Mean().init,
        task=TrainTask(Mean().apply, optax.sgd(0.2), update=sampled_update),
        rnkey=jax.random.key(SEED),
        n_steps=12,
        input_sample=np.ones((1, 1), np.float32),
        devices=jax.devices()[:1],
        stdout=False,
        **options,
    )


def test_a_step_without_data_runs_n_steps_as_written_by_hand():
    (last,) = list(sampled_loop(n_steps_per_checkpoint=12))
    mu = jnp.zeros(2)
    for number in range(12):
        samples = jax.random.normal(the_rng(number), (64, 2)) + jnp.asarray([3.0, -1.0])
        grad = jax.grad(lambda m: ((m * jnp.ones((64, 1)) - samples) ** 2).mean())(mu)
        mu = mu - 0.2 * grad
    assert last.step == 12
    np.testing.assert_allclose(last.model_params["mu"], mu, rtol=1e-6)
    np.testing.assert_allclose(last.model_params["mu"], [3.0, -1.0], atol=0.2)
    by_three = list(sampled_loop(n_steps_per_checkpoint=3))[-1]
    same(by_three.model_params, last.model_params)


def test_the_built_in_transforms_apply_to_your_own_step():
    # the moving average follows the parameters the step's update gave
    (last,) = list(scaling_loop(1, optax.sgd(0.05), ema_decay=0.5, n_steps_per_checkpoint=1))
    start = initial(REGRESSOR, X[:32])
    jax.tree.map(
        lambda ema, a, b: np.testing.assert_allclose(ema, 0.5 * a + 0.5 * b, rtol=1e-6),
        last.ema_params,
        start,
        last.model_params,
    )

    # a non-finite step is skipped whole: parameters and carry as they were
    def poisoned(state, batch, *, rng, step):
        state, metrics = plain_update(state, batch, rng=rng, step=step)
        loss = jnp.where(step == 1, jnp.nan, metrics["loss"])
        return state.replace(carry={"n": state.carry["n"] + 1}), {"loss": loss}

    loop = TrainLoop(
        init=REGRESSOR.init,
        task=TrainTask(
            REGRESSOR.apply, optax.sgd(0.1), data=ResumableBatches(X, Y, 32), update=poisoned,
            carry={"n": jnp.int32(0)},
        ),
        rnkey=jax.random.key(0),
        n_steps=3,
        n_steps_per_checkpoint=3,
        nonfinite="skip",
        devices=jax.devices()[:1],
        stdout=False,
    )  # fmt: skip
    (last,) = list(loop)
    assert last.n_nonfinite_steps == 1 and int(last.carried["carry"]["n"]) == 2


def test_an_nnx_variable_written_in_your_own_step_carries_over_and_a_parameter_is_refused():
    """As under compute_loss: a non-parameter nnx.Variable the step writes is
    carried (3.0 after three +1 steps); a trained parameter assigned is an
    ApplyError naming it."""
    from flax import nnx

    class Count(nnx.Variable):
        pass

    class Counting(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
            self.seen = Count(jnp.zeros(()))

        def __call__(self, x):
            return self.linear(x)[:, 0]

    def counting(state, batch, *, rng, step):
        x, y = batch
        model = state.model()
        model.seen[...] = model.seen[...] + 1
        grads = jax.grad(lambda p: ((state.model(p)(x) - y) ** 2).mean())(state.params)
        return state.apply_gradients(grads), {"loss": jnp.float32(0)}

    def assigning(state, batch, *, rng, step):
        model = state.model()
        model.linear.bias[...] = model.linear.bias[...] + 1
        return state, {"loss": jnp.float32(0)}

    module = Counting()
    loop = TrainLoop(
        init=module,
        task=TrainTask(module, optax.sgd(0.1), data=ResumableBatches(X, Y, 32), update=counting),
        rnkey=jax.random.key(0),
        n_steps=3,
        n_steps_per_checkpoint=3,
        devices=jax.devices()[:1],
        stdout=False,
    )
    assert float(loop.next_checkpoint().model_state["seen"]) == 3.0
    with pytest.raises(ApplyError, match="linear/bias"):
        TrainLoop(
            init=module,
            task=TrainTask(
                module, optax.sgd(0.1), data=ResumableBatches(X, Y, 32), update=assigning
            ),
            rnkey=jax.random.key(0),
            n_steps=3,
            devices=jax.devices()[:1],
            stdout=False,
        )


def test_a_step_without_data_and_without_input_sample_is_told_what_to_pass():
    def drawn(state, batch, *, rng, step):
        return state, {"loss": jnp.float32(0)}

    with pytest.raises(
        ConfigError, match=r"reads no data \(TrainTask\(data=None\)\).*input_sample"
    ):
        TrainLoop(
            init=REGRESSOR.init,
            task=TrainTask(REGRESSOR.apply, optax.sgd(0.1), update=drawn, data=None),
            rnkey=jax.random.key(0),
            n_steps=2,
            devices=jax.devices()[:1],
            stdout=False,
        )


def test_a_carry_added_or_dropped_on_resume_is_refused(tmp_path):
    """A task's carry is part of what its step computes: a file with one is
    not resumed without it, nor a file without one by a task that has one."""
    from flax_loop.errors import CheckpointMismatchError

    def counting(state, batch, *, rng, step):
        state, metrics = plain_update(state, batch, rng=rng, step=step)
        if state.carry is None:
            return state, metrics
        return state.replace(carry={"n": state.carry["n"] + 1}), metrics

    def loop(directory, **task):
        return TrainLoop(
            init=CheckpointFileReader(dir=str(directory), target=REGRESSOR.init),
            task=TrainTask(
                REGRESSOR.apply, optax.sgd(0.1), data=ResumableBatches(X, Y, 32),
                update=counting, **task,
            ),
            rnkey=jax.random.key(0), n_steps=4, n_steps_per_checkpoint=2,
            devices=jax.devices()[:1], stdout=False,
        )  # fmt: skip

    with_carry, without = tmp_path / "with", tmp_path / "without"
    for directory, task in ((with_carry, {"carry": {"n": jnp.int32(0)}}), (without, {})):
        with CheckpointFileWriter(output_dir=str(directory)) as write:
            write(loop(directory, **task).next_checkpoint())
    with pytest.raises(
        CheckpointMismatchError, match="the file carries 'carry'.*this task does not"
    ):
        loop(with_carry)
    with pytest.raises(
        CheckpointMismatchError, match="this task carries 'carry'.*the file does not"
    ):
        loop(without, carry={"n": jnp.int32(0)})
    assert loop(with_carry, carry={"n": jnp.int32(0)}).step == 2  # as it was written: resumes
