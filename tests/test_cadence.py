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

from tests.flags import xla_flags
from tests.helpers import ROOT

PROGRAM = textwrap.dedent(
    """
    import itertools, json, sys
    import jax, numpy as np, optax
    from flax_loop import TrainLoop, TrainTask
    from tests.helpers import BatchNormDropoutNet, cross_entropy, digits_split

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

    every_run = len(sys.argv) > 1  # all cadences on 4 devices too
    differences, n_leaves = {}, {}
    for n_devices, sharding in ((1, "replicated"), (4, "replicated"), (4, "fsdp")):
        reference = final(n_devices, sharding, 24, 1)
        n_leaves[f"{n_devices} {sharding}"] = len(reference)
        cadences = (1, 2, 3, 24) if n_devices == 1 or every_run else (1, 24)
        for every in cadences:
            for steps_per_dispatch in (1, 4):
                if (every, steps_per_dispatch) == (24, 1) or (
                    (every, steps_per_dispatch) == (1, 4) and cadences == (1, 24)
                ):
                    continue  # the reference itself; (1, 4) runs on 1 device
                leaves = final(n_devices, sharding, every, steps_per_dispatch)
                differences[f"{n_devices} {sharding}, cadence/dispatch {every}/{steps_per_dispatch}"] = [
                    int(np.sum(a != b)) for a, b in zip(reference, leaves)
                ]
    print("RESULT " + json.dumps({"differences": differences, "n_leaves": n_leaves}))
    """
)


def test_params_are_bitwise_the_same_for_any_cadence_and_dispatch():
    # BatchNorm (batch statistics, a mutated collection) and Dropout (keys
    # per step): before the gradient was materialized alike in every variant
    # of the step, cadences 1, 2 and 3 ended 4e-2 away from cadence 24.
    flags = [flag for flag in xla_flags(4).split() if "optimization_level" not in flag]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, *(["all"] if os.environ.get("FLAX_LOOP_SLOW") else [])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    found = json.loads(line.removeprefix("RESULT "))
    # params, batch statistics, Adam's moments, on 1 and 4 devices, replicated and fsdp
    assert min(found["n_leaves"].values()) >= 8 and len(found["n_leaves"]) == 3
    # cadences 1, 2, 3, 24 x dispatch 1, 4 against (24, 1) on 1 device, and
    # on 4 devices (1, 1) and (24, 4): every variant (all with FLAX_LOOP_SLOW=1)
    assert len(found["differences"]) == (3 * 7 if os.environ.get("FLAX_LOOP_SLOW") else 7 + 2 * 2)
    for run, counts in found["differences"].items():
        assert sum(counts) == 0, f"{run}: {counts} values differ"
