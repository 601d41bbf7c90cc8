"""PPO on CartPole, the environment written in jax.numpy: a step of your own.

    python examples/ppo_cartpole.py [--steps 150] [--dir ppo-checkpoints]

Each step collects a rollout with the current policy (4 environments, 128
steps each, inside the compiled step), computes advantages (GAE), then
runs 4 epochs of 4 minibatches of Adam updates on it. The environments'
state is carried from step to step (`TrainTask(carry=...)`), so a run
stopped at a checkpoint resumes bit for bit; the task reads no data
stream (`data=None`). Run it again to resume from its checkpoints.
"""

import argparse
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from flax_loop import CheckpointFileReader, CheckpointFileWriter, TrainLoop, TrainTask

# -- CartPole-v1 in jax.numpy ------------------------------------------------

GRAVITY, CART_MASS, POLE_MASS, HALF_LENGTH, FORCE, DT = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
THETA_LIMIT, X_LIMIT, MAX_STEPS = 12 * 2 * np.pi / 360, 2.4, 500


def reset(key):
    """A new episode: the state drawn in [-0.05, 0.05], time 0."""
    return {"obs": jax.random.uniform(key, (4,), minval=-0.05, maxval=0.05), "t": jnp.int32(0)}


def env_step(state, action, key):
    """One step of one environment; a finished episode starts again at once.
    Returns (state, observation, reward, done)."""
    x, x_dot, theta, theta_dot = state["obs"]
    force = jnp.where(action == 1, FORCE, -FORCE)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    total = CART_MASS + POLE_MASS
    temp = (force + POLE_MASS * HALF_LENGTH * theta_dot**2 * sin) / total
    theta_acc = (GRAVITY * sin - cos * temp) / (
        HALF_LENGTH * (4.0 / 3.0 - POLE_MASS * cos**2 / total)
    )
    x_acc = temp - POLE_MASS * HALF_LENGTH * theta_acc * cos / total
    obs = jnp.stack(
        [x + DT * x_dot, x_dot + DT * x_acc, theta + DT * theta_dot, theta_dot + DT * theta_acc]
    )
    t = state["t"] + 1
    done = (jnp.abs(obs[0]) > X_LIMIT) | (jnp.abs(obs[2]) > THETA_LIMIT) | (t >= MAX_STEPS)
    fresh = reset(key)
    state = {"obs": jnp.where(done, fresh["obs"], obs), "t": jnp.where(done, 0, t)}
    return state, state["obs"], jnp.float32(1.0), done


# -- the policy and the algorithm --------------------------------------------

N_ENVS, N_STEPS, N_EPOCHS, N_MINIBATCHES = 4, 128, 4, 4
GAMMA, LAMBDA, CLIP, VALUE_COEF, ENTROPY_COEF = 0.99, 0.95, 0.2, 0.5, 0.01


class ActorCritic(nn.Module):
    @nn.compact
    def __call__(self, obs):
        def mlp(out, name):
            h = nn.tanh(nn.Dense(64, name=f"{name}_0")(obs))
            h = nn.tanh(nn.Dense(64, name=f"{name}_1")(h))
            return nn.Dense(out, name=f"{name}_out")(h)

        return mlp(2, "actor"), mlp(1, "critic")[..., 0]


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array
    value: jax.Array
    log_prob: jax.Array


def rollout(policy, envs, obs, key):
    """`N_STEPS` steps of the `N_ENVS` environments under `policy(obs) ->
    (logits, value)`: the environments and observations after, the
    transitions (stacked by time) and the value of the last observations."""

    def one(carry, key):
        envs, obs = carry
        logits, value = policy(obs)
        act_key, env_key = jax.random.split(key)
        action = jax.random.categorical(act_key, logits)
        log_prob = jax.nn.log_softmax(logits)[jnp.arange(N_ENVS), action]
        envs, next_obs, reward, done = jax.vmap(env_step)(
            envs, action, jax.random.split(env_key, N_ENVS)
        )
        return (envs, next_obs), Transition(obs, action, reward, done, value, log_prob)

    (envs, obs), moves = jax.lax.scan(one, (envs, obs), jax.random.split(key, N_STEPS))
    return envs, obs, moves, policy(obs)[1]


def advantages(moves, last_value):
    """Generalized advantage estimates and value targets."""

    def back(carry, move):
        gae, next_value = carry
        delta = move.reward + GAMMA * next_value * (1 - move.done) - move.value
        gae = delta + GAMMA * LAMBDA * (1 - move.done) * gae
        return (gae, move.value), gae

    _, gae = jax.lax.scan(back, (jnp.zeros_like(last_value), last_value), moves, reverse=True)
    return gae, gae + moves.value


def ppo_loss(policy, batch):
    """The clipped surrogate, the value loss and the entropy bonus."""
    moves, gae, targets = batch
    logits, value = policy(moves.obs)
    log_probs = jax.nn.log_softmax(logits)
    log_prob = jnp.take_along_axis(log_probs, moves.action[:, None], axis=1)[:, 0]
    ratio = jnp.exp(log_prob - moves.log_prob)
    gae = (gae - gae.mean()) / (gae.std() + 1e-8)
    actor = -jnp.minimum(ratio * gae, jnp.clip(ratio, 1 - CLIP, 1 + CLIP) * gae).mean()
    clipped = moves.value + jnp.clip(value - moves.value, -CLIP, CLIP)
    critic = 0.5 * jnp.maximum((value - targets) ** 2, (clipped - targets) ** 2).mean()
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1).mean()
    return actor + VALUE_COEF * critic - ENTROPY_COEF * entropy


def minibatches(batch, key):
    """The rollout's `N_ENVS * N_STEPS` samples shuffled into `N_MINIBATCHES`."""
    size = N_ENVS * N_STEPS
    order = jax.random.permutation(key, size)
    return jax.tree.map(
        lambda x: x.reshape(size, *x.shape[2:])[order].reshape(N_MINIBATCHES, -1, *x.shape[2:]),
        batch,
    )


def returns_after(moves, running, last):
    """The running return of each environment after the rollout, and the
    mean return of the episodes it finished (`last` if none)."""

    def one(carry, move):
        running, total, count = carry
        running = running + move.reward
        total = total + jnp.where(move.done, running, 0).sum()
        return (jnp.where(move.done, 0, running), total, count + move.done.sum()), None

    (running, total, count), _ = jax.lax.scan(one, (running, 0.0, 0), moves)
    return running, jnp.where(count > 0, total / jnp.maximum(count, 1), last)


def update(state, batch, *, rng, step):
    """One PPO iteration: a rollout, then 4 epochs x 4 minibatches of Adam."""
    rollout_key, epochs_key = jax.random.split(rng)
    carry = state.carry
    envs, obs, moves, last_value = rollout(state.model(), carry["envs"], carry["obs"], rollout_key)
    gae, targets = advantages(moves, last_value)

    def epoch(state, key):
        def minibatch(state, batch):
            loss, grads = jax.value_and_grad(lambda p: ppo_loss(state.model(p), batch))(
                state.params
            )
            return state.apply_gradients(grads), loss

        return jax.lax.scan(minibatch, state, minibatches((moves, gae, targets), key))

    state, losses = jax.lax.scan(epoch, state, jax.random.split(epochs_key, N_EPOCHS))
    running, episode_return = returns_after(moves, carry["running"], carry["return"])
    carry = {"envs": envs, "obs": obs, "running": running, "return": episode_return}
    return state.replace(carry=carry), {"loss": losses.mean(), "return": episode_return}


def first_carry(key):
    """The environments' first state (and the returns' bookkeeping)."""
    envs = jax.vmap(reset)(jax.random.split(key, N_ENVS))
    return {
        "envs": envs,
        "obs": envs["obs"],
        "running": jnp.zeros(N_ENVS),
        "return": jnp.float32(0.0),
    }


OPTIMIZER = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(2.5e-4, eps=1e-5))


def make_loop(n_steps, init, **options):
    model = ActorCritic()
    task = TrainTask(
        model.apply, OPTIMIZER, data=None, update=update, carry=first_carry(jax.random.key(1))
    )
    return TrainLoop(
        init=init,
        task=task,
        rnkey=jax.random.key(0),
        input_sample=np.zeros((1, 4), np.float32),
        n_steps=n_steps,
        # the environments of one policy: a small step, fastest on one device
        devices=jax.devices()[:1],
        **options,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="PPO iterations to train to")
    parser.add_argument("--every", type=int, default=25, help="steps between checkpoints")
    parser.add_argument("--dir", default="ppo-checkpoints", help="the checkpoints' directory")
    args = parser.parse_args()
    reader = CheckpointFileReader(dir=args.dir, target=ActorCritic().init)
    loop = make_loop(args.steps, reader, n_steps_per_checkpoint=args.every)
    with CheckpointFileWriter(output_dir=args.dir) as write:
        for checkpoint in loop:
            write(checkpoint)
            print(
                f"step {checkpoint.step}: mean episode return "
                f"{float(checkpoint.carry['return']):.1f}"
            )


if __name__ == "__main__":
    main()
