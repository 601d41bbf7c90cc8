"""bfloat16 computation with float32 master weights and optimizer state."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tests.helpers import cross_entropy, digits_loop


class HalfMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x))
        return nn.Dense(10, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)


class HalfNNX(nnx.Module):
    def __init__(self, *, rngs):
        self.hidden = nnx.Linear(64, 64, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.out = nnx.Linear(64, 10, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def float32_loss(logits, labels):
    return cross_entropy(logits.astype(jnp.float32), labels)  # the loss in full precision


def check(checkpoints):
    first, last = checkpoints[0], checkpoints[-1]
    assert last.mean_loss < 0.6 * first.mean_loss  # it learns
    for leaf in jax.tree.leaves((last.model_params, last.optimizer_state)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32, leaf.dtype
    assert all(np.isfinite(checkpoint.mean_loss) for checkpoint in checkpoints)


def test_a_bfloat16_linen_model_keeps_float32_weights_and_learns():
    model = HalfMLP()
    loop = digits_loop(model, optax.adam(1e-2), n_steps=120, n_steps_per_checkpoint=40)
    outputs = model.apply({"params": loop.next_step().model_params}, np.ones((2, 64), np.float32))
    assert outputs.dtype == jnp.bfloat16
    check(list(loop))


def test_a_bfloat16_nnx_model_keeps_float32_weights_and_learns():
    from flax_loop import TrainLoop, TrainTask
    from tests.helpers import ResumableBatches, digits_split

    x, y, _, _ = digits_split()
    model = HalfNNX(rngs=nnx.Rngs(0))
    loop = TrainLoop(
        init=model,
        task=TrainTask(model, optax.adam(1e-2), float32_loss, ResumableBatches(x, y, 32)),
        rnkey=jax.random.key(0),
        n_steps=120,
        n_steps_per_checkpoint=40,
        stdout=False,
    )
    check(list(loop))
