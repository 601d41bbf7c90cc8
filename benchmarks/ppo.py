"""PPO 4x4 as a step of your own against the same iteration written by hand.

    python benchmarks/ppo.py [--rounds 5] [--steps 60]

The step is examples/ppo_cartpole.py's: a rollout of 4 jax.numpy CartPoles
for 128 steps, GAE, then 4 epochs of 4 minibatches of Adam. The baseline
is the hand-written loop purejaxrl's `_update_step` makes of it: one
`jax.jit` of the iteration (parameters, optimizer state and environments
donated) called in a Python loop. flax_loop runs it with `data=None`, one
checkpoint a round. Rounds alternate the two (after a warm-up round each);
the figure is the median of per-round ratios of seconds (flax_loop / by
hand; <= 1.0 is the target).
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import ppo_cartpole as ppo  # noqa: E402


def iteration(params, opt_state, carry, key):
    """One PPO iteration on plain arrays."""
    model = ppo.ActorCritic()

    def policy(p):
        return lambda obs: model.apply({"params": p}, obs)

    rollout_key, epochs_key = jax.random.split(key)
    envs, obs, moves, last = ppo.rollout(policy(params), carry["envs"], carry["obs"], rollout_key)
    gae, targets = ppo.advantages(moves, last)

    def minibatch(runner, batch):
        params, opt_state = runner
        loss, grads = jax.value_and_grad(lambda p: ppo.ppo_loss(policy(p), batch))(params)
        updates, opt_state = ppo.OPTIMIZER.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def epoch(runner, key):
        return jax.lax.scan(minibatch, runner, ppo.minibatches((moves, gae, targets), key))

    (params, opt_state), losses = jax.lax.scan(
        epoch, (params, opt_state), jax.random.split(epochs_key, ppo.N_EPOCHS)
    )
    running, episode_return = ppo.returns_after(moves, carry["running"], carry["return"])
    carry = {"envs": envs, "obs": obs, "running": running, "return": episode_return}
    return params, opt_state, carry, losses.mean()


def by_hand():
    """run(n) -> seconds for n iterations of the hand-written loop."""
    step = jax.jit(iteration, donate_argnums=(0, 1, 2))
    params = ppo.ActorCritic().init(jax.random.key(0), np.zeros((1, 4), np.float32))["params"]
    carry = jax.tree.map(jax.numpy.array, ppo.first_carry(jax.random.key(1)))  # own buffers
    state = [params, ppo.OPTIMIZER.init(params), carry]
    key = jax.random.key(0)
    done = [0]

    def run(n):
        started = time.perf_counter()
        for _ in range(n):
            done[0] += 1
            *state[:], loss = step(*state, jax.random.fold_in(key, done[0]))
        loss.block_until_ready()
        return time.perf_counter() - started

    return run


def with_loop(steps_per_dispatch):
    """run(n) -> seconds for n steps of the flax_loop task, one checkpoint."""
    loop = ppo.make_loop(
        10**6,
        ppo.ActorCritic().init,
        n_steps_per_checkpoint=10**6,
        steps_per_dispatch=steps_per_dispatch,
        stdout=False,
    )

    def run(n):
        started = time.perf_counter()
        for checkpoint in loop.run(loop.step + n):
            float(checkpoint.mean_loss)
        return time.perf_counter() - started

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    runs = {
        "by hand": by_hand(),
        "flax_loop": with_loop(1),
        "flax_loop, 4 a dispatch": with_loop(4),
    }
    for run in runs.values():
        run(8)  # compiled, warm
    seconds = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            seconds[name].append(run(args.steps))
    hand = seconds["by hand"]
    print(f"PPO 4x4 on CartPole, {args.steps} iterations a round, {args.rounds} rounds")
    for name, times in seconds.items():
        ratio = statistics.median(t / h for t, h in zip(times, hand))
        print(
            f"  {name:<24} {statistics.median(times) / args.steps * 1e3:7.2f} ms an iteration"
            f"   ratio to by hand {ratio:.3f}"
        )


if __name__ == "__main__":
    main()
