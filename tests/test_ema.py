"""An exponential moving average of the parameters, kept on the devices."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
    EvalLoop,
    EvalTask,
    OrbaxCheckpointReader,
    OrbaxCheckpointWriter,
)
from flax_loop.errors import ConfigError
from tests.flags import default_xla_flags
from tests.helpers import MLP, ROOT, ResumableBatches, accuracy, digits_loop, digits_split

X, Y, X_TEST, Y_TEST = digits_split()
DECAY = 0.9


def ema_loop(n_steps=8, every=1, **options):
    options.setdefault("data", ResumableBatches(X, Y, 32))
    return digits_loop(
        optimizer=optax.sgd(0.1),
        n_steps=n_steps,
        n_steps_per_checkpoint=every,
        ema_decay=DECAY,
        **options,
    )


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("options", [{"n_devices": 1}, {"sharding": "fsdp", "fsdp_min_bytes": 0}])
def test_the_average_follows_a_numpy_ema_of_the_parameters(options):
    start = MLP().init(jax.random.key(3), X[:1])["params"]
    loop = ema_loop(init=lambda *args, **kwargs: {"params": start}, **options)
    expected = host(start)
    for checkpoint in loop:
        params = host(checkpoint.model_params)
        expected = jax.tree.map(
            lambda average, new: average + np.float32(1 - DECAY) * (new - average),
            expected,
            params,
        )
        for got, want in zip(
            jax.tree.leaves(host(checkpoint.ema_params)), jax.tree.leaves(expected)
        ):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert checkpoint.step == 8
    # It lags the parameters, as an average should.
    assert not np.allclose(
        host(checkpoint.ema_params)["Dense_0"]["kernel"], params["Dense_0"]["kernel"]
    )
    if "sharding" in options:
        kernel = checkpoint.ema_params["Dense_0"]["kernel"]
        assert kernel.sharding == checkpoint.model_params["Dense_0"]["kernel"].sharding


AT_ANY_DISPATCH = textwrap.dedent(
    """
    import jax, numpy as np
    from tests.helpers import MLP
    from tests.test_ema import ema_loop, host

    model = MLP(features=(129, 257))  # widths no multiple of a vector's lanes

    def ending(steps_per_dispatch):
        loop = ema_loop(n_steps=12, every=12, model=model, n_devices=1,
                        steps_per_dispatch=steps_per_dispatch)
        (checkpoint,) = loop
        return jax.tree.leaves(host((checkpoint.ema_params, checkpoint.model_params)))

    one_at_a_time = ending(1)
    for steps_per_dispatch in (2, 5):
        differing = [int(np.sum(a != b)) for a, b in zip(ending(steps_per_dispatch), one_at_a_time)]
        print(steps_per_dispatch, sum(differing))
    """
)


def test_the_average_keeps_its_bits_for_any_steps_per_dispatch():
    # With XLA's default optimizations (the suite's own compile without them,
    # tests/flags.py), a scan of steps once fused the average's multiply-add
    # otherwise than a single step did: 3e-8 apart in about a third of the
    # values, the parameters bitwise.
    result = subprocess.run(
        [sys.executable, "-c", AT_ANY_DISPATCH],
        cwd=ROOT, env={**os.environ, "XLA_FLAGS": default_xla_flags(1)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["2", "0", "5", "0"], result.stdout


@pytest.mark.parametrize(
    "writer, reader",
    [(CheckpointFileWriter, CheckpointFileReader), (OrbaxCheckpointWriter, OrbaxCheckpointReader)],
    ids=["file", "orbax"],
)
def test_the_average_resumes_bitwise_from_a_checkpoint(tmp_path, writer, reader):
    straight = list(ema_loop(n_steps=8, every=4))[-1]
    with writer(output_dir=str(tmp_path)) as write:
        write(ema_loop(n_steps=4, every=4).next_checkpoint())
    resumed = ema_loop(n_steps=8, every=4, init=reader(dir=str(tmp_path), target=MLP().init))
    assert resumed.step == 4
    ending = list(resumed)[-1]
    for a, b in zip(
        jax.tree.leaves(host(ending.ema_params)), jax.tree.leaves(host(straight.ema_params))
    ):
        np.testing.assert_array_equal(a, b)
    # A loop without an average resumes from the same directory, ignoring it.
    plain = digits_loop(
        optimizer=optax.sgd(0.1), n_steps=8, init=reader(dir=str(tmp_path), target=MLP().init)
    )
    assert plain.step == 4 and list(plain)[-1].ema_params is None


def test_eval_loop_evaluates_the_average_when_asked():
    checkpoint = list(ema_loop(n_steps=20, every=20))[-1]
    task = EvalTask(MLP().apply, {"accuracy": accuracy}, [(X_TEST, Y_TEST)])
    on_average = EvalLoop(task, rnkey=jax.random.key(1), use_ema=True)(checkpoint)
    on_params = EvalLoop(task, rnkey=jax.random.key(1))(checkpoint)
    logits = MLP().apply({"params": checkpoint.ema_params}, X_TEST)
    expected = float(np.mean(np.argmax(np.asarray(logits), -1) == Y_TEST))
    assert on_average.metrics["eval"]["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert on_average.metrics["eval"]["accuracy"] != on_params.metrics["eval"]["accuracy"]
    without = digits_loop(n_steps=1).next_checkpoint()
    with pytest.raises(ConfigError, match="no ema_params"):
        EvalLoop(task, rnkey=jax.random.key(1), use_ema=True)(without)


@pytest.mark.parametrize("decay", [0, 1, 1.5, -0.1, "0.9"])
def test_a_decay_outside_zero_and_one_is_a_config_error(decay):
    with pytest.raises(ConfigError, match="ema_decay"):
        digits_loop(n_steps=1, ema_decay=decay)


def test_early_stopping_recipe_keeps_the_best_weights(tmp_path):
    """README's recipe, with accuracies scripted so that the best is known."""
    from flax_loop import HighestCheckpointFileReader, HighestCheckpointFileWriter
    from flax_loop.checkpoint import Summary

    scripted = iter([0.50, 0.70, 0.65, 0.69, 0.70, 0.90])  # best 0.70 at the 2nd, stalls 3x

    def evaluate(checkpoint):
        return Summary(**vars(checkpoint), metrics={"eval": {"accuracy": next(scripted)}})

    keep_best = HighestCheckpointFileWriter(
        metric="accuracy", output_dir=str(tmp_path), stdout=False
    )
    since_best, seen = 0, []
    for checkpoint in digits_loop(n_steps=12, n_steps_per_checkpoint=2):
        seen.append(checkpoint)
        before = keep_best.best_metric
        keep_best(evaluate(checkpoint))
        since_best = 0 if keep_best.best_metric != before else since_best + 1
        if since_best == 3:
            break
    keep_best.close()
    assert [checkpoint.step for checkpoint in seen] == [2, 4, 6, 8, 10]  # stopped before 0.90
    best = HighestCheckpointFileReader(
        dir=str(tmp_path), target=MLP().init, metric="accuracy"
    ).read_newest()
    assert best.step == 4 and best.metrics["eval"]["accuracy"] == pytest.approx(0.70)
    for a, b in zip(
        jax.tree.leaves(best.model_params), jax.tree.leaves(host(seen[1].model_params))
    ):
        np.testing.assert_array_equal(a, b)
