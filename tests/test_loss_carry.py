"""A `compute_loss` that carries arrays (`TrainTask(carry=...)`, the loss
taking `carry=` and returning `(loss, metrics, new_carry)`): against the
same step in plain JAX, resumed from a file, on four devices, and its
mistakes named."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_loop import CheckpointFileReader, CheckpointFileWriter, TrainLoop, TrainTask
from flax_loop.errors import ConfigError, LossError

X = np.random.default_rng(0).normal(size=(512, 4)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 5.0).astype(np.float32)
MODEL = nn.Dense(1)
OPTIMIZER = optax.sgd(0.05)
START = {"mean": jnp.float32(0.0), "seen": jnp.int32(0)}


def batches():
    return [{"x": X[i : i + 32], "y": Y[i : i + 32]} for i in range(0, len(X), 32)]


def centred(predict, batch, carry):
    """The loss on targets centred by a running mean of them, and the mean moved."""
    error = predict(batch["x"])[:, 0] - (batch["y"] - carry["mean"])
    mean = 0.9 * carry["mean"] + 0.1 * batch["y"].mean()
    return (error**2).mean(), {"mean": mean, "seen": carry["seen"] + 1}


def compute_loss(model, batch, *, rng, step, carry):
    loss, new = centred(model, batch, carry)
    return loss, {"target_mean": new["mean"]}, new


@jax.jit
def by_hand(params, opt_state, carry, batch):
    def loss_of(p):
        return centred(lambda x: MODEL.apply({"params": p}, x), batch, carry)

    (_, carry), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, carry


def loop(n_steps, every=1, init=None, devices=1, **options):
    return TrainLoop(
        init=init or MODEL.init,
        task=TrainTask(
            MODEL.apply, OPTIMIZER, data=batches(), compute_loss=compute_loss, carry=START
        ),
        rnkey=jax.random.key(0),
        input_sample=X[:1],
        n_steps=n_steps,
        n_steps_per_checkpoint=every,
        devices=jax.devices()[:devices],
        stdout=False,
        **options,
    )


def same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_the_loss_carries_its_arrays_as_plain_jax_does():
    checkpoints = list(loop(5))
    assert int(checkpoints[-1].carry["seen"]) == 5
    data = batches()
    for before, after in zip(checkpoints, checkpoints[1:]):
        params, opt_state, carry = by_hand(
            before.model_params, before.optimizer_state, before.carry, data[before.step]
        )
        same(after.model_params, params)
        same(after.carry, carry)
    # the metric the loss reported is the interval's mean of the new mean
    assert np.isclose(
        checkpoints[-1].train_metrics["target_mean"], float(checkpoints[-1].carry["mean"])
    )


def test_the_carry_resumes_bit_for_bit_at_any_cadence(tmp_path):
    straight = list(loop(8, every=8))[-1]
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        for checkpoint in loop(3, every=3):
            write(checkpoint)
    resumed = list(
        loop(8, every=5, init=CheckpointFileReader(dir=str(tmp_path), target=MODEL.init))
    )[-1]
    grouped = list(loop(8, every=8, steps_per_dispatch=4))[-1]
    for other in (resumed, grouped):
        same(other.carry, straight.carry)
        same(other.model_params, straight.model_params)


def test_four_devices_carry_what_one_carries():
    one, four = list(loop(4, every=4))[-1], list(loop(4, every=4, devices=4))[-1]
    assert int(four.carry["seen"]) == 4  # an integer stays as it is
    np.testing.assert_allclose(four.carry["mean"], one.carry["mean"], rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        four.model_params,
        one.model_params,
    )


def test_a_carrying_loss_is_checked():
    def without_carry(model, batch, *, rng, step):
        return centred(model, batch, START)[0]

    with pytest.raises(ConfigError, match=r"compute_loss\(model, batch, \*, rng, step, carry\)"):
        TrainLoop(
            init=MODEL.init,
            task=TrainTask(
                MODEL.apply, OPTIMIZER, data=batches(), compute_loss=without_carry, carry=START
            ),
            rnkey=jax.random.key(0),
            input_sample=X[:1],
            stdout=False,
        )

    def two(model, batch, *, rng, step, carry):
        return compute_loss(model, batch, rng=rng, step=step, carry=carry)[:2]

    with pytest.raises(LossError, match=r"returns \(loss, metrics, new_carry\).*a tuple of 2"):
        TrainLoop(
            init=MODEL.init,
            task=TrainTask(MODEL.apply, OPTIMIZER, data=batches(), compute_loss=two, carry=START),
            rnkey=jax.random.key(0),
            input_sample=X[:1],
            stdout=False,
        )
