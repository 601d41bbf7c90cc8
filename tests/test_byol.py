"""BYOL as a step of your own: the target network in `carry` (started as the
online one by a function of the initial parameters), moved after each
update under a cosine tau schedule; against the same step in plain JAX,
resumed from a file and at another cadence."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits

from flax_loop import CheckpointFileReader, CheckpointFileWriter, TrainLoop, TrainTask
from flax_loop.random import loss_key, train_key

pytestmark = pytest.mark.usefixtures("one_device")

DIGITS = (load_digits().data / 16.0).astype(np.float32)
BATCH, N_STEPS, TAU_BASE = 64, 12, 0.99
OPTIMIZER = optax.adamw(3e-3, weight_decay=1e-4)


class Byol(nn.Module):
    def setup(self):
        self.encoder = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(16)])
        self.projector = nn.Dense(8)
        self.predictor = nn.Dense(8)

    def __call__(self, x):
        return self.predictor(self.projector(self.encoder(x)))

    def project(self, x):
        return self.projector(self.encoder(x))


MODEL = Byol()


def augment(x, key):
    """A view: pixels dropped at random, then noise."""
    keep, noise = jax.random.split(key)
    return x * jax.random.bernoulli(keep, 0.8, x.shape) + 0.1 * jax.random.normal(noise, x.shape)


def regression(p, z):
    p, z = (
        p / jnp.linalg.norm(p, axis=-1, keepdims=True),
        z / jnp.linalg.norm(z, axis=-1, keepdims=True),
    )
    return (2 - 2 * (p * z).sum(-1)).mean()


def byol_loss(online, target, x, key):
    one, two = augment(x, jax.random.fold_in(key, 1)), augment(x, jax.random.fold_in(key, 2))
    return regression(online(one), target(two)) + regression(online(two), target(one))


def tau(step):
    return 1 - (1 - TAU_BASE) * (jnp.cos(math.pi * step / N_STEPS) + 1) / 2


def moved(target, params, step):
    return jax.tree.map(lambda t, p: tau(step) * t + (1 - tau(step)) * p, target, params)


def update(state, batch, *, rng, step):
    target = {**state.params, **state.carry}

    def loss_of(params):
        return byol_loss(
            state.model(params),
            lambda x: state.model(target)(x, method="project"),
            batch,
            rng,
        )

    loss, grads = jax.value_and_grad(loss_of)(state.params)
    state = state.apply_gradients(grads)
    online = {name: state.params[name] for name in state.carry}
    return state.replace(carry=moved(state.carry, online, step)), {"loss": loss, "tau": tau(step)}


@jax.jit
def by_hand(params, opt_state, target, x, rng, step):
    full = {**params, **target}

    def loss_of(p):
        return byol_loss(
            lambda v: MODEL.apply({"params": p}, v),
            lambda v: MODEL.apply({"params": full}, v, method="project"),
            x,
            rng,
        )

    grads = jax.grad(loss_of)(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, moved(target, {k: params[k] for k in target}, step)


def batches():
    return [DIGITS[i : i + BATCH] for i in range(0, BATCH * N_STEPS, BATCH)]


def loop(n_steps, every, init=MODEL.init, **options):
    return TrainLoop(
        init=init,
        task=TrainTask(
            MODEL.apply,
            OPTIMIZER,
            data=batches(),
            update=update,
            carry=lambda params: {"encoder": params["encoder"], "projector": params["projector"]},
        ),
        rnkey=jax.random.key(0),
        input_sample=DIGITS[:1],
        n_steps=n_steps,
        n_steps_per_checkpoint=every,
        devices=jax.devices()[:1],  # also in the module fixture, made before one_device
        stdout=False,
        **options,
    )


def same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def straight():
    """8 steps, a checkpoint each: the reference of the tests here."""
    return list(loop(8, 1))


def test_byol_moves_its_target_as_plain_jax_does(straight):
    first = straight[0]
    assert sorted(first.carry) == ["encoder", "projector"]
    data = batches()
    for before, after in zip(straight[:3], straight[1:4]):
        rng = loss_key(train_key(jax.random.key(0)), before.step + 1, 0)
        params, _, target = by_hand(
            before.model_params,
            before.optimizer_state,
            before.carry,
            data[before.step],
            rng,
            before.step,
        )
        same((after.model_params, after.carry), (params, target))
    # the target lags: it is neither where it started nor the online network
    last = straight[-1]
    kernel = last.carry["projector"]["kernel"]
    assert not np.array_equal(kernel, first.carry["projector"]["kernel"])
    assert not np.array_equal(kernel, last.model_params["projector"]["kernel"])


def test_byol_resumes_bit_for_bit_at_any_cadence(straight, tmp_path):
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        for checkpoint in loop(3, 3):
            write(checkpoint)
    reader = CheckpointFileReader(dir=str(tmp_path), target=MODEL.init)
    for other in (list(loop(8, 7, init=reader))[-1], list(loop(8, 8, steps_per_dispatch=4))[-1]):
        same((other.model_params, other.carry), (straight[-1].model_params, straight[-1].carry))
