"""Non-finite losses and gradients: raise at the next checkpoint, or skip."""

import jax
import numpy as np
import optax
import pytest

from flax_loop import TrainLoop, TrainTask
from flax_loop.errors import NonFiniteError
from tests.helpers import BatchNormDropoutNet, batches, cross_entropy, digits_loop, digits_split

X_TRAIN, Y_TRAIN, _, _ = digits_split()


def poisoned(bad_batch):
    for index, (x, y) in enumerate(batches(X_TRAIN, Y_TRAIN, 32)):
        if index == bad_batch:
            x = x.copy()
            x[3, 5] = np.nan
        yield x, y


def poisoned_loop(nonfinite, n_devices=2):
    """A BatchNorm and Dropout net on batches poisoned at step 6."""
    return digits_loop(
        BatchNormDropoutNet(),
        data=poisoned(6),
        n_devices=n_devices,
        n_steps=20,
        n_steps_per_checkpoint=5,
        collections={"apply": ["dropout"]},
        nonfinite=nonfinite,
    )


def test_raise_names_the_first_bad_step_at_the_next_checkpoint():
    loop = poisoned_loop("raise", n_devices=2)
    assert loop.next_checkpoint().step == 5
    with pytest.raises(
        NonFiniteError, match=r"first at step 7 .*may have come at step 6.*detected at step 10"
    ):
        loop.next_checkpoint()


def test_skip_leaves_params_and_statistics_unchanged_and_goes_on():
    loop = poisoned_loop("skip", n_devices=2)
    at_six = list(loop.run(6))[-1]
    assert at_six.step == 6
    at_seven = loop.next_step()
    assert at_seven.n_nonfinite_steps == 1 and np.isnan(at_seven.loss)
    assert np.isnan(at_seven.mean_loss)  # the interval held only the bad step
    for a, b in [
        (at_six.model_params, at_seven.model_params),
        (at_six.model_state, at_seven.model_state),
    ]:
        jax.tree.map(
            np.testing.assert_array_equal, jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b)
        )
    rest = list(loop)
    assert [c.step for c in rest] == [10, 15, 20]
    assert rest[0].n_nonfinite_steps == 0 and np.isfinite(rest[0].mean_loss)
    params = jax.tree.leaves(rest[-1].model_params)
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in params)
    assert not np.allclose(
        np.asarray(params[0]), np.asarray(jax.tree.leaves(at_seven.model_params)[0])
    )


def test_skip_mean_loss_leaves_the_bad_step_out():
    loop = poisoned_loop("skip", n_devices=1)
    assert loop.next_checkpoint().n_nonfinite_steps == 0
    second = loop.next_checkpoint()
    assert second.step == 10 and second.n_nonfinite_steps == 1
    assert np.isfinite(second.mean_loss)


def test_a_nonfinite_gradient_with_a_finite_loss_is_caught_at_the_checkpoint():
    import jax.numpy as jnp

    from tests.helpers import MLP

    def loss(logits, labels, poison):
        # sqrt has an infinite derivative at 0, times the zero derivative of
        # logits * 0: a NaN gradient under a finite loss where poison is 1.
        return cross_entropy(logits, labels) + jnp.mean(jnp.sqrt(logits * 0.0 + 1.0 - poison))

    def data():
        for index, (x, y) in enumerate(batches(X_TRAIN, Y_TRAIN, 32)):
            yield x, (y, np.full((32, 1), float(index == 4), np.float32))

    model = MLP()
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.sgd(0.1), loss, data()),
        rnkey=jax.random.key(0),
        n_steps=10,
        n_steps_per_checkpoint=5,
        stdout=False,
    )
    with pytest.raises(NonFiniteError, match=r"between steps 1 and 5; detected at step 5"):
        loop.next_checkpoint()


def test_a_nan_gradient_under_a_finite_loss_is_named_with_the_step_it_may_have_come_at():
    import jax.numpy as jnp

    from tests.helpers import MLP

    model = MLP(features=(16,))

    def loss(model, batch, *, rng, step):
        x, y = batch
        logits = model(x)
        # at the fifth step (step 4 counted from 0): a finite loss, a NaN gradient
        # (d sqrt(u)/du at 0 is infinite, times 0)
        zero = jnp.abs(logits[0, 0] - logits[0, 0])
        trap = jax.lax.cond(step == 4, lambda: 0.0 * jnp.sqrt(zero), lambda: 0.0 * zero)
        return cross_entropy(logits, y) + trap

    loop = TrainLoop(
        init=model.init,
        task=TrainTask(
            model.apply, optax.sgd(0.1), data=batches(X_TRAIN, Y_TRAIN, 32), compute_loss=loss
        ),
        rnkey=jax.random.key(0),
        n_steps=10,
        n_steps_per_checkpoint=10,
        input_sample=X_TRAIN[:1],
        devices=jax.devices()[:1],
        stdout=False,
    )
    with pytest.raises(
        NonFiniteError, match=r"first at step 6 .*may have come at step 5\).*detected at step 10"
    ):
        loop.next_checkpoint()
