"""Several models trained together (`TrainTask(apply={"generator": g, "critic": d})`):
parameters by model name, each optimizer of the same name training its
model; linen and NNX; a compute_loss step and your own step against the same
updates written in plain JAX; resumed from a file; the mistakes named."""

import flax.linen as nn
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
from flax_loop.errors import ConfigError

REAL = np.random.default_rng(0).normal(size=(256, 2)).astype(np.float32) + [2, -1]
NOISE = np.random.default_rng(1).normal(size=(256, 3)).astype(np.float32)
BATCH = 32
GENERATOR, CRITIC = nn.Dense(2), nn.Dense(1)
OPTIMIZERS = {"critic": optax.sgd(0.05), "generator": optax.sgd(0.02)}


def batches():
    """(real, noise) pairs, the same stream every time."""
    return [
        {"real": REAL[i : i + BATCH], "z": NOISE[i : i + BATCH]} for i in range(0, len(REAL), BATCH)
    ]


def critic_loss(critic, generator, batch):
    fake = generator(batch["z"])
    return critic(fake).mean() - critic(batch["real"]).mean() + 0.1 * (critic(fake) ** 2).mean()


def generator_loss(critic, generator, batch):
    return -critic(generator(batch["z"])).mean()


LOSSES = {
    "critic": lambda model, batch, *, rng, step: critic_loss(
        model["critic"], model["generator"], batch
    ),
    "generator": lambda model, batch, *, rng, step: generator_loss(
        model["critic"], model["generator"], batch
    ),
}


@jax.jit
def by_hand(params, opt_state, batch):
    """One step in plain JAX: the critic's update, then the generator's with
    the critic just updated."""

    def models(p):
        return (
            lambda x: CRITIC.apply({"params": p["critic"]}, x),
            lambda z: GENERATOR.apply({"params": p["generator"]}, z),
        )

    def critic_of(critic_params):
        return critic_loss(*models({**params, "critic": critic_params}), batch)

    grads = jax.grad(critic_of)(params["critic"])
    updates, critic_state = OPTIMIZERS["critic"].update(grads, opt_state["critic"])
    params = {**params, "critic": optax.apply_updates(params["critic"], updates)}

    def generator_of(generator_params):
        return generator_loss(*models({**params, "generator": generator_params}), batch)

    grads = jax.grad(generator_of)(params["generator"])
    updates, generator_state = OPTIMIZERS["generator"].update(grads, opt_state["generator"])
    params = {**params, "generator": optax.apply_updates(params["generator"], updates)}
    return params, {"critic": critic_state, "generator": generator_state}


def linen_loop(n_steps, every=1, init=None, **task):
    models = {"generator": GENERATOR.apply, "critic": CRITIC.apply}
    return TrainLoop(
        init=init or {"generator": GENERATOR.init, "critic": CRITIC.init},
        task=TrainTask(models, OPTIMIZERS, compute_loss=LOSSES, data=batches(), **task),
        rnkey=jax.random.key(0),
        input_sample={"generator": NOISE[:1], "critic": REAL[:1]},
        n_steps=n_steps,
        n_steps_per_checkpoint=every,
        devices=jax.devices()[:1],
        stdout=False,
    )


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_each_optimizer_trains_its_model_as_plain_jax_does():
    checkpoints = list(linen_loop(4))
    params = checkpoints[0].model_params
    assert sorted(params) == ["critic", "generator"]
    assert params["critic"]["kernel"].shape == (2, 1)
    assert params["generator"]["kernel"].shape == (3, 2)
    # the two models start from keys of their own
    assert not np.array_equal(params["critic"]["kernel"][:, 0], params["generator"]["kernel"][0])
    data = batches()
    for before, after in zip(checkpoints, checkpoints[1:]):
        params, opt_state = by_hand(before.model_params, before.optimizer_state, data[before.step])
        assert_same(after.model_params, params)
        assert_same(after.optimizer_state, opt_state)


def test_several_models_resume_bit_for_bit(tmp_path):
    straight = list(linen_loop(6, every=3))[-1]
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        for checkpoint in linen_loop(3, every=3):
            write(checkpoint)
    inits = {"generator": GENERATOR.init, "critic": CRITIC.init}
    reader = CheckpointFileReader(dir=str(tmp_path), target=inits)
    (resumed,) = list(linen_loop(6, every=3, init=reader))
    assert resumed.step == 6
    assert_same(resumed.model_params, straight.model_params)
    assert_same(resumed.optimizer_state, straight.optimizer_state)


class Critic(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(2, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.linear(x))))


def test_nnx_models_by_name_and_your_own_step():
    generator = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    critic = Critic(nnx.Rngs(1))
    models = {"generator": generator, "critic": critic}
    start = nnx.to_pure_dict(nnx.state(nnx.Dict(**models), nnx.Param))

    def update(state, batch, *, rng, step):
        def critic_of(params):
            model = state.model(params)
            loss = critic_loss(model["critic"], model["generator"], batch)
            return loss, state.model_state_after(model)  # the batch statistics

        for _ in range(2):  # two critic updates, then one of the generator
            (loss, model_state), grads = jax.value_and_grad(critic_of, has_aux=True)(state.params)
            state = state.apply_gradients(grads, "critic").replace(model_state=model_state)

        def generator_of(params):
            model = state.model(params)
            return generator_loss(model["critic"], model["generator"], batch)

        grads = jax.grad(generator_of)(state.params)
        return state.apply_gradients(grads, "generator"), {"loss": loss}

    loop = TrainLoop(
        init=models,
        task=TrainTask(
            models,
            {"critic": optax.adam(1e-3), "generator": optax.sgd(0.02)},
            update=update,
            data=batches(),
        ),
        rnkey=jax.random.key(0),
        n_steps=3,
        n_steps_per_checkpoint=3,
        devices=jax.devices()[:1],
        stdout=False,
    )
    (checkpoint,) = list(loop)
    params = checkpoint.model_params
    assert sorted(params) == ["critic", "generator"]
    # the critic's batch statistics are carried, by model name
    assert sorted(checkpoint.model_state) == ["critic"]
    assert not np.allclose(checkpoint.model_state["critic"]["norm"]["mean"], 0)
    # each optimizer moved its model; the critic's Adam counted two updates a step
    assert not np.allclose(
        params["critic"]["linear"]["kernel"], start["critic"]["linear"]["kernel"]
    )
    assert not np.allclose(params["generator"]["kernel"], start["generator"]["kernel"])
    assert int(checkpoint.optimizer_state["critic"][0].count) == 6
    # and the modules given are never changed
    assert_same(nnx.to_pure_dict(nnx.state(nnx.Dict(**models), nnx.Param)), start)


def test_the_mistakes_of_several_models_are_named():
    models = {"generator": GENERATOR.apply, "critic": CRITIC.apply}
    with pytest.raises(
        ConfigError, match=r"dict of models \['generator', 'critic'\].*compute_loss"
    ):
        TrainLoop(
            init={"generator": GENERATOR.init, "critic": CRITIC.init},
            task=TrainTask(models, optax.sgd(0.1), lambda out, y: out.mean(), data=batches()),
            rnkey=jax.random.key(0),
            n_steps=1,
            stdout=False,
        )
    with pytest.raises(ConfigError, match=r"input_sample=\{name: inputs\}"):
        TrainLoop(
            init={"generator": GENERATOR.init, "critic": CRITIC.init},
            task=TrainTask(models, OPTIMIZERS, compute_loss=LOSSES, data=batches()),
            rnkey=jax.random.key(0),
            n_steps=1,
            stdout=False,
        )
    mixed = {"generator": nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "critic": CRITIC.apply}
    with pytest.raises(ConfigError, match="mixes NNX modules and linen apply functions"):
        TrainLoop(
            init=mixed,
            task=TrainTask(mixed, OPTIMIZERS, compute_loss=LOSSES, data=batches()),
            rnkey=jax.random.key(0),
            n_steps=1,
            stdout=False,
        )
    with pytest.raises(ConfigError, match="an evaluation calls one model"):
        EvalLoop(
            EvalTask(models, {"mean": lambda out, y: out.mean()}, batches()), jax.random.key(0)
        )
