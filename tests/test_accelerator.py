"""The core promises on the default backend's first device: a CPU in the suite,
the GPU or TPU where `benchmarks/on_device.sh` runs the suite's tests on one
(`JAX_PLATFORMS` set to it: tests/conftest.py keeps it).

A GPU computes a program's reductions in an order of its own, so the loop
and a hand-written step (two programs) agree to a tolerance there, and a
resumed run (the same programs) bit for bit with XLA's deterministic ops.
"""

import itertools

import jax
import numpy as np
import pytest

from flax_loop import CheckpointFileReader, CheckpointFileWriter, EvalLoop, EvalTask
from flax_loop.run.memory import device_limit
from flax_loop.run.throughput import device_peak
from tests.helpers import (
    MLP,
    accuracy,
    batches,
    digits_loop,
    digits_split,
    hand_trained,
    relative_difference,
)

X_TRAIN, Y_TRAIN, X_TEST, Y_TEST = digits_split()
DEVICE = jax.devices()[0]


def on_device(**options):
    return digits_loop(devices=[DEVICE], **options)


def test_the_loop_learns_digits_and_steps_as_a_hand_written_step():
    data = list(itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 40))
    loop = on_device(data=data, n_steps=400, n_steps_per_checkpoint=400)
    (checkpoint,) = list(loop)
    task = EvalTask(MLP().apply, {"accuracy": accuracy}, [(X_TEST, Y_TEST)])
    evaluate = EvalLoop(task, rnkey=jax.random.key(1), devices=[DEVICE])
    assert evaluate(checkpoint).metrics["eval"]["accuracy"] > 0.93

    # the first 20 steps against `jax.jit` of the same Adam step on the same
    # device (`hand_trained`: its batches, its parameters from key 0)
    def init(rngs, x, **options):
        return MLP().init(jax.random.key(0), x, **options)

    first = list(on_device(init=init, n_steps=20, n_steps_per_checkpoint=20))[-1]
    expected = hand_trained(20, 20)[-1]
    assert relative_difference(first.model_params, expected.model_params) < 1e-4


def test_a_resumed_run_is_the_straight_run_bit_for_bit(tmp_path):
    data = list(itertools.islice(batches(X_TRAIN, Y_TRAIN, 32), 8))
    straight = list(on_device(data=data, n_steps=8, n_steps_per_checkpoint=4))[-1]
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        write(on_device(data=data, n_steps=4, n_steps_per_checkpoint=4).next_checkpoint())
    resumed = on_device(
        data=data,
        n_steps=8,
        n_steps_per_checkpoint=4,
        init=CheckpointFileReader(dir=str(tmp_path), target=MLP().init),
    )
    assert resumed.step == 4
    ending = list(resumed)[-1]
    for a, b in zip(jax.tree.leaves(ending.model_params), jax.tree.leaves(straight.model_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_memory_plan_and_the_throughput_know_the_device():
    loop = on_device(n_steps=4, n_steps_per_checkpoint=4)
    (checkpoint,) = list(loop)
    plan, limit = loop.memory_plan(), device_limit(DEVICE)
    assert plan["total"] > 0
    if limit is not None:  # a GPU or TPU states its memory: the plan fits in it
        assert plan["total"] < limit
    rates = checkpoint.throughput
    assert rates["flops_per_step"] > 0
    if device_peak(DEVICE) is None:
        assert "mfu" not in rates
    else:
        assert 0 < rates["mfu"] < 1
        assert rates["mfu"] == pytest.approx(
            rates["flops_per_second_per_device"] / device_peak(DEVICE)
        )
