"""The caller's hand between checkpoints: `loop.update_state(fn)` and
`loop.set_hyperparams(...)` change what the next step takes, without
compiling the step again, and the next checkpoint holds it."""

import io
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from rich.console import Console

from flax_loop import CheckpointFileReader, CheckpointFileWriter, set_console
from flax_loop.errors import ConfigError
from flax_loop.random import init_key, into_collection
from tests.flags import xla_flags
from tests.helpers import (
    MLP,
    ROOT,
    ResumableBatches,
    cross_entropy,
    digits_loop,
    digits_split,
)

X, Y, _, _ = digits_split()
MODEL = MLP(features=(32,))


def sgd_loop(optimizer, **options):
    return digits_loop(
        MODEL,
        optimizer,
        ResumableBatches(X, Y, 32),
        n_devices=1,
        n_steps=8,
        n_steps_per_checkpoint=4,
        **options,
    )


def by_hand(rates):
    """Plain SGD on the same batches, one learning rate per step."""
    params = MODEL.init(into_collection(init_key(jax.random.key(0)), ["params"]), X[:32])["params"]
    data = ResumableBatches(X, Y, 32)

    @jax.jit
    def step(params, x, y, rate):
        grads = jax.grad(lambda p: cross_entropy(MODEL.apply({"params": p}, x), y))(params)
        return jax.tree.map(lambda p, g: p - rate * g, params, grads)

    for rate in rates:
        params = step(params, *next(data), np.float32(rate))
    return params


def test_set_hyperparams_halves_the_learning_rate_from_the_next_step(tmp_path):
    loop = sgd_loop(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    first = loop.next_checkpoint()
    programs = dict(loop.compiled.programs)
    loop.set_hyperparams(learning_rate=0.05)
    second = loop.next_checkpoint()
    assert first.train_metrics["learning_rate"] == pytest.approx(0.1)
    assert second.train_metrics["learning_rate"] == pytest.approx(0.05)
    assert all(loop.compiled.programs[name] is program for name, program in programs.items())
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        second.model_params,
        by_hand([0.1] * 4 + [0.05] * 4),
    )
    CheckpointFileWriter(output_dir=str(tmp_path))(second)  # the file holds the new rate
    file = CheckpointFileReader(dir=str(tmp_path), target=MODEL.init).read_newest()
    assert float(file.optimizer_state["hyperparams"]["learning_rate"]) == pytest.approx(0.05)
    # a run resumed from it with the task's 0.1 trains with the task's, and says so
    shown = io.StringIO()
    set_console(Console(file=shown, width=300))
    reader = CheckpointFileReader(dir=str(tmp_path), target=MODEL.init)
    resumed = sgd_loop(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), init=reader)
    resumed.n_steps = 12
    assert resumed.next_checkpoint().train_metrics["learning_rate"] == pytest.approx(0.1)
    assert "training goes on with the task's (learning_rate 0.05 -> 0.1;" in shown.getvalue()


def test_update_state_changes_what_the_next_step_takes():
    loop = sgd_loop(optax.sgd(0.1))
    loop.next_checkpoint()
    zeroed = {}

    def zero_the_last_layer(saved):
        params = dict(saved.model_params)
        params["Dense_1"] = jax.tree.map(np.zeros_like, params["Dense_1"])
        zeroed.update(params)
        return saved.map_arrays(lambda arrays: {**arrays, "model_params": params})

    loop.update_state(zero_the_last_layer)
    second = loop.next_checkpoint()
    assert second.step == 8
    # four SGD steps from zeros: small, and the zeros did not survive by accident
    kernel = np.asarray(second.model_params["Dense_1"]["kernel"])
    assert 0 < np.abs(kernel).max() < 0.5


def test_bad_hands_are_named():
    loop = sgd_loop(optax.sgd(0.1))
    loop.next_checkpoint()

    def widens(saved):
        return saved.map_arrays(
            lambda arrays: {
                **arrays,
                "model_params": jax.tree.map(
                    lambda a: np.asarray(a, np.float64), arrays["model_params"]
                ),
            }
        )

    with pytest.raises(ConfigError, match=r"changed model_params/Dense_0/bias from float32\[32\]"):
        loop.update_state(widens)
    with pytest.raises(ConfigError, match="must return the saved state"):
        loop.update_state(lambda saved: saved.model_params)
    with pytest.raises(ConfigError, match="keeps no injected hyperparameters"):
        loop.set_hyperparams(learning_rate=0.01)
    with pytest.raises(ConfigError, match="one optimizer: leave name out"):
        loop.set_hyperparams(name="critic", learning_rate=0.01)
    injected = sgd_loop(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    with pytest.raises(ConfigError, match=r"no injected hyperparameter \['lr'\]"):
        injected.set_hyperparams(lr=0.01)
    assert loop.next_checkpoint().step == 8  # the loop goes on after each refusal


def test_a_scheduled_hyperparameter_is_refused_naming_the_schedule():
    """A value set on a hyperparameter a schedule sets at every step would be
    overwritten at the next step: refused, and the steps after it follow the
    schedule."""
    schedule = optax.linear_schedule(0.1, 0.0, 8)
    loop = sgd_loop(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule, momentum=0.5))
    loop.next_checkpoint()
    with pytest.raises(ConfigError, match="sets learning_rate from a schedule at every step"):
        loop.set_hyperparams(learning_rate=0.05)
    loop.set_hyperparams(momentum=0.0)  # a constant beside it is set
    second = loop.next_checkpoint()
    assert second.train_metrics["momentum"] == pytest.approx(0.0)
    assert second.train_metrics["learning_rate"] == pytest.approx(float(schedule(7)))


def test_a_change_made_in_the_body_is_in_the_file_the_body_writes_after_it(tmp_path):
    """ReduceLROnPlateau's shape: at checkpoint 4 the body halves the rate,
    then writes; the file holds the halved rate and the run resumed from it
    (keeping the file's rate) trains the bits of the run never stopped."""
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    writer = CheckpointFileWriter(output_dir=str(tmp_path), keep=5)
    straight = sgd_loop(optimizer)
    for checkpoint in straight:
        if checkpoint.step == 4:
            straight.set_hyperparams(learning_rate=0.05)
            assert checkpoint.optimizer_state.hyperparams["learning_rate"] == np.float32(0.05)
            writer(checkpoint)
    file = CheckpointFileReader(dir=str(tmp_path), target=MODEL.init).read_newest()
    assert file.step == 4
    assert float(file.optimizer_state["hyperparams"]["learning_rate"]) == pytest.approx(0.05)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        checkpoint.model_params,
        by_hand([0.1] * 4 + [0.05] * 4),
    )


def test_a_resumed_run_keeps_the_files_rate_when_asked_and_says_so(tmp_path):
    """The halved rate set after checkpoint 4 is in the file written after
    it; resumed with hyperparams="file", the run trains on at it, the bits
    of plain SGD with the rate halved after step 4."""
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    first = sgd_loop(optimizer)
    checkpoint = first.next_checkpoint()
    first.set_hyperparams(learning_rate=0.05)
    CheckpointFileWriter(output_dir=str(tmp_path))(checkpoint)
    shown = io.StringIO()
    set_console(Console(file=shown, width=300))
    try:
        reader = CheckpointFileReader(dir=str(tmp_path), target=MODEL.init)
        resumed = sgd_loop(optimizer, init=reader, hyperparams="file")
    finally:
        set_console(None)
    last = list(resumed)[-1]
    assert last.step == 8 and last.train_metrics["learning_rate"] == pytest.approx(0.05)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        last.model_params,
        by_hand([0.1] * 4 + [0.05] * 4),
    )
    said = " ".join(shown.getvalue().split())
    assert (
        "training goes on with the file's, as hyperparams='file' asks (learning_rate 0.05" in said
    )
    with pytest.raises(ConfigError, match="hyperparams must be one of"):
        sgd_loop(optimizer, hyperparams="newest")


KILL_AFTER_WRITE = """
import os, signal
import flax_loop

_at, _write = int(os.environ.get("KILL_AT", "0")), flax_loop.CheckpointFileWriter.__call__


def _write_then_maybe_die(self, checkpoint):
    written = _write(self, checkpoint)
    print("WROTE", checkpoint.step, flush=True)
    if checkpoint.step == _at:
        os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of any kind
    return written


flax_loop.CheckpointFileWriter.__call__ = _write_then_maybe_die
_set = flax_loop.TrainLoop.set_hyperparams


def _noted(self, **values):
    print("HALVED", self.step, flush=True)
    return _set(self, **values)


flax_loop.TrainLoop.set_hyperparams = _noted
"""


def plateau_recipe():
    """own_step.md's ReduceLROnPlateau block as a program, with what it
    continues from (the imports, the model, the data), as a reader runs it."""
    import re

    with open(os.path.join(ROOT, "docs", "guides", "own_step.md")) as guide:
        blocks = re.findall(r"```python\n(.*?)```", guide.read(), re.S)
    recipe = next(block for block in blocks if "caller_state" in block)
    model = next(block for block in blocks if "class Regressor" in block)
    model = model[model.index("class Regressor") : model.index("def scaled")]
    data = [line for line in next(b for b in blocks if "\nx = " in b).splitlines()]
    data = "\n".join(line for line in data if line.startswith(("x = ", "y = ")))
    imports = "import flax.linen as nn\nimport jax\nimport numpy as np\nimport optax\n"
    imports += "from flax_loop import TrainLoop, TrainTask\n"
    return KILL_AFTER_WRITE + imports + model + data + "\n" + recipe


def test_the_plateau_recipe_resumes_bit_for_bit_after_sigkill(tmp_path):
    """Killed right after the file that first holds a halved rate (and, with
    FLAX_LOOP_SLOW=1, after every file), then run again: the same final
    file (step, parameters, optimizer state, the recipe's counters) as the
    run never stopped."""
    program = tmp_path / "plateau.py"
    program.write_text(plateau_recipe())
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}

    def run(directory, kill_at=0):
        directory.mkdir(exist_ok=True)
        result = subprocess.run(
            [sys.executable, str(program)], cwd=directory, env={**env, "KILL_AT": str(kill_at)},
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == (-9 if kill_at else 0), result.stdout + result.stderr
        return result.stdout

    said = run(tmp_path / "straight")
    halved = [int(line.split()[1]) for line in said.splitlines() if line.startswith("HALVED")]
    written = [int(line.split()[1]) for line in said.splitlines() if line.startswith("WROTE")]
    assert halved and written[-1] < 400  # it halved the rate, and stopped early
    straight = CheckpointFileReader(
        dir=str(tmp_path / "straight" / "plateau"), target=None
    ).read_newest()
    kill_points = written[:-1] if os.environ.get("FLAX_LOOP_SLOW") else [halved[0]]
    for kill_at in kill_points:
        directory = tmp_path / f"killed-{kill_at}"
        run(directory, kill_at)
        run(directory)  # run again: resumes from the file of step `kill_at`
        resumed = CheckpointFileReader(dir=str(directory / "plateau"), target=None).read_newest()
        assert resumed.step == straight.step and resumed.caller_state == straight.caller_state
        for a, b in zip(jax.tree.leaves(resumed.arrays()), jax.tree.leaves(straight.arrays())):
            np.testing.assert_array_equal(a, b)
        again = run(directory)  # a third run: stopped early before, trains nothing
        assert "WROTE" not in again


def test_a_finished_loop_gives_its_state_without_training(tmp_path):
    """Run again, a finished phase trains nothing; current_checkpoint() gives
    the state it holds (read back from its file), the bits the first run
    trained, for the next phase to start from."""
    optimizer = optax.sgd(0.1)
    first = sgd_loop(optimizer)
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        for checkpoint in first:
            write(checkpoint)
    trained = first.current_checkpoint()
    assert trained is checkpoint and trained.n_completed_steps == 4  # the newest one
    again = sgd_loop(optimizer, init=CheckpointFileReader(dir=str(tmp_path), target=MODEL.init))
    assert list(again) == []
    held = again.current_checkpoint()
    assert held.step == 8 and held.n_completed_steps == 0
    for a, b in zip(jax.tree.leaves(held.model_params), jax.tree.leaves(trained.model_params)):
        np.testing.assert_array_equal(a, b)
