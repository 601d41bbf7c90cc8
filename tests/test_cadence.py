"""A run computes the same bits whatever its checkpoint cadence and steps per dispatch.

The suite compiles with LLVM's optimizations off (tests/conftest.py), where
the variants of the step happened to agree even when they did not with
XLA's defaults; so these runs happen in a process with XLA's defaults.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.flags import xla_flags
from tests.helpers import ROOT

PROGRAM = textwrap.dedent(
    """
    import itertools, json, sys
    import jax, numpy as np, optax
    from flax_loop import TrainLoop, TrainTask
    from tests.helpers import BatchNormDropoutNet, cross_entropy, digits_split

    from tests.test_cadence import RUNS, RUNS_OF

    x, y, _, _ = digits_split()

    def data():  # batches in order, as a file-backed source gives them
        for i in itertools.count():
            start = (i * 32) % (len(x) - 32)
            yield x[start : start + 32], y[start : start + 32]

    def final(n_devices, sharding, every, steps_per_dispatch):
        model = BatchNormDropoutNet()
        loop = TrainLoop(
            init=model.init,
            task=TrainTask(model.apply, optax.adam(1e-2), cross_entropy, data()),
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
    reference = final(n_devices, sharding, 24, 1)
    differences = {}
    for every, steps_per_dispatch in RUNS if every_run else RUNS_OF[n_devices]:
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
# and (1, 1) call: only with FLAX_LOOP_SLOW=1, with every run on 4 devices
# (by default there (1, 1) and (24, 4), whose last call is a closing call).
RUNS = ((1, 1), (2, 1), (3, 1), (1, 4), (2, 4), (3, 4), (24, 4))
RUNS_OF = {1: ((1, 1), (2, 1), (2, 4), (3, 4), (24, 4)), 4: ((1, 1), (24, 4))}


@pytest.mark.parametrize("n_devices, sharding", [(1, "replicated"), (4, "replicated"), (4, "fsdp")])
def test_params_are_bitwise_the_same_for_any_cadence_and_dispatch(n_devices, sharding):
    # BatchNorm (batch statistics, a mutated collection) and Dropout (keys
    # per step): before the gradient was materialized alike in every variant
    # of the step, cadences 1, 2 and 3 ended 4e-2 away from cadence 24.
    flags = [flag for flag in xla_flags(4).split() if "optimization_level" not in flag]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    every_run = "all" if os.environ.get("FLAX_LOOP_SLOW") else "some"
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(n_devices), sharding, every_run],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    found = json.loads(line.removeprefix("RESULT "))
    # params, batch statistics and Adam's moments
    assert found["n_leaves"] >= 8
    runs = RUNS if every_run == "all" else RUNS_OF[n_devices]
    assert len(found["differences"]) == len(runs)
    for run, counts in found["differences"].items():
        assert sum(counts) == 0, f"{run}: {counts} values differ"
