"""PPO on a jax.numpy CartPole as a step of your own (examples/ppo_cartpole.py):
each step against the same iteration written by hand in plain JAX, as
purejaxrl writes it; killed with SIGKILL and resumed bit for bit by running
the example again; the same bits at any cadence and steps_per_dispatch."""

import glob
import os
import signal
import sys
import time

import jax
import numpy as np
import pytest

from flax_loop import CheckpointFileWriter
from flax_loop.checkpoint import list_checkpoints
from flax_loop.checkpoint.parse import read
from flax_loop.random import loss_key, train_key
from tests.helpers import ROOT, run, start

sys.path.insert(0, os.path.join(ROOT, "examples"))
import ppo_cartpole as ppo  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_device")


def the_rng(step):
    """The `rng` the loop gives a step (counted from 0) on its device."""
    return loss_key(train_key(jax.random.key(0)), step + 1, 0)


@jax.jit
def by_hand(params, opt_state, carry, rng):
    """One PPO iteration on plain arrays: rollout, GAE, 4 epochs of 4 minibatches."""
    model = ppo.ActorCritic()
    rollout_key, epochs_key = jax.random.split(rng)
    envs, obs, moves, last = ppo.rollout(
        lambda o: model.apply({"params": params}, o), carry["envs"], carry["obs"], rollout_key
    )
    gae, targets = ppo.advantages(moves, last)

    def epoch(runner, key):
        def minibatch(runner, batch):
            params, opt_state = runner
            grads = jax.grad(
                lambda p: ppo.ppo_loss(lambda o: model.apply({"params": p}, o), batch)
            )(params)
            updates, opt_state = ppo.OPTIMIZER.update(grads, opt_state, params)
            return (jax.tree.map(lambda p, u: p + u, params, updates), opt_state), None

        return jax.lax.scan(minibatch, runner, ppo.minibatches((moves, gae, targets), key))[0], None

    (params, opt_state), _ = jax.lax.scan(
        epoch, (params, opt_state), jax.random.split(epochs_key, ppo.N_EPOCHS)
    )
    running, episode_return = ppo.returns_after(moves, carry["running"], carry["return"])
    carry = {"envs": envs, "obs": obs, "running": running, "return": episode_return}
    return params, opt_state, carry


def same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def straight():
    """A run of 8 steps, a checkpoint each: the reference of every test here."""
    return list(ppo.make_loop(8, ppo.ActorCritic().init, n_steps_per_checkpoint=1, stdout=False))


def test_each_ppo_step_is_the_hand_written_iteration(straight):
    for before, after in zip(straight[:3], straight[1:4]):
        params, opt_state, carry = by_hand(
            before.model_params, before.optimizer_state, before.carry, the_rng(before.step)
        )
        # Adam counted 16 updates a step
        assert int(after.optimizer_state[1][0].count) == 16 * after.step
        same((after.model_params, after.carry), (params, carry))


def test_ppo_keeps_its_bits_at_any_cadence(straight):
    for options in (
        {"n_steps_per_checkpoint": 7},
        {"n_steps_per_checkpoint": 8, "steps_per_dispatch": 4},
    ):
        other = list(ppo.make_loop(8, ppo.ActorCritic().init, stdout=False, **options))[-1]
        same(other.model_params, straight[-1].model_params)
        same(other.carry, straight[-1].carry)


KILLED_RUN = """
import sys, time
sys.path.insert(0, "examples")
import ppo_cartpole as ppo
from flax_loop import CheckpointFileWriter
loop = ppo.make_loop(8, ppo.ActorCritic().init, n_steps_per_checkpoint=4, stdout=False)
with CheckpointFileWriter(output_dir=sys.argv[1]) as write:
    for checkpoint in loop:
        write(checkpoint)
        time.sleep(60)  # killed here, after the first checkpoint's file
"""


def test_ppo_killed_and_run_again_resumes_bit_for_bit(tmp_path, straight):
    directory = str(tmp_path / "ppo")
    process = start([sys.executable, "-c", KILLED_RUN, directory])
    try:
        deadline = time.monotonic() + 120
        while not glob.glob(os.path.join(directory, "*4*")) and process.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint file after 120 s"
            time.sleep(0.2)
        time.sleep(0.5)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL, process.stdout.read()
    command = [sys.executable, "examples/ppo_cartpole.py", "--steps", "8", "--every", "4"]
    printed = run([*command, "--dir", directory])
    assert "step 8: mean episode return" in printed and "step 4:" not in printed
    uninterrupted = str(tmp_path / "straight")
    with CheckpointFileWriter(output_dir=uninterrupted) as write:
        write(straight[-1])
    (resumed,), (expected,) = (list_checkpoints(d)[-1:] for d in (directory, uninterrupted))
    assert resumed.step == expected.step == 8
    arrays, _ = read(resumed.path)
    same(arrays, read(expected.path)[0])
