"""A field declared once, by the transform that carries it: the loop places,
counts, saves, restores and shows it by its name, with no other change."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from rich.console import Console

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
    OrbaxCheckpointReader,
    OrbaxCheckpointWriter,
    TrainLoop,
    TrainTask,
)
from flax_loop.output.cli import main
from flax_loop.step import Field, Step
from tests.helpers import MLP, ResumableBatches, cross_entropy, digits_split

X, Y, _, _ = digits_split()
MODEL = MLP()


def tracked(step: Step) -> Step:
    """Counts the updates and keeps the largest magnitude each parameter
    reached: two fields of its own, one replicated, one shaped as the
    parameters."""

    def init(given):
        return {
            **step.init(given),
            "n_updates": jnp.zeros((), jnp.int32),
            "peak_params": jax.tree.map(jnp.abs, given["model_params"]),
        }

    def update(carried, batch, context):
        new, outcome = step.update(carried, batch, context)
        peak = jax.tree.map(
            lambda old, param: jnp.maximum(old, jnp.abs(param)),
            carried["peak_params"],
            new["model_params"],
        )
        return {**new, "n_updates": carried["n_updates"] + 1, "peak_params": peak}, outcome

    fields = {**step.fields, "n_updates": Field(), "peak_params": Field(mirrors_params=True)}
    return Step(init, update, fields)


def tracking_loop(n_steps, init=None, **options):
    task = TrainTask(
        MODEL.apply,
        optax.adam(1e-2),
        cross_entropy,
        ResumableBatches(X, Y, 32),
        transforms=[tracked],
    )
    options.setdefault("n_steps_per_checkpoint", 4)
    return TrainLoop(
        init=init or MODEL.init,
        task=task,
        rnkey=jax.random.key(0),
        n_steps=n_steps,
        devices=jax.devices()[:1],
        stdout=False,
        **options,
    )


def same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def straight():
    """8 steps, a checkpoint every 4: the run the others are held against."""
    return list(tracking_loop(8))


def test_the_field_is_carried_and_checkpointed(straight):
    first, last = straight
    assert sorted(last.carried) == ["n_updates", "peak_params"]
    assert int(first.carried["n_updates"]) == 4 and int(last.carried["n_updates"]) == 8
    for peak, earlier, param in zip(
        jax.tree.leaves(last.carried["peak_params"]),
        jax.tree.leaves(first.carried["peak_params"]),
        jax.tree.leaves(last.model_params),
    ):
        assert np.all(peak >= np.abs(param)) and np.all(peak >= earlier)
        assert np.any(peak > earlier)  # the parameters moved, and the peak with them


def test_the_memory_plan_counts_the_field():
    plan = tracking_loop(8).memory_plan()
    assert plan["n_updates"] == 4  # one int32, replicated
    assert plan["peak_params"] == plan["params"]  # shaped as the parameters
    state = ("params", "model_state", "optimizer_state", "n_updates", "peak_params")
    assert plan["checkpoint"] == sum(plan[part] for part in state)


def test_a_file_holds_the_field_and_shows_it(straight, tmp_path):
    last = straight[-1]
    CheckpointFileWriter(output_dir=str(tmp_path))(last)
    file = CheckpointFileReader(dir=str(tmp_path), target=MODEL.init).read_newest()
    same(file.carried, jax.tree.map(np.asarray, last.carried))
    shown = io.StringIO()
    assert main(["show", file.path], Console(file=shown, width=200)) == 0
    assert "n_updates" in shown.getvalue()
    assert "peak_params/Dense_0/kernel" in shown.getvalue()


@pytest.mark.parametrize("store", ["file", "orbax"])
def test_a_resumed_run_continues_the_field_bit_for_bit(straight, store, tmp_path):
    writer, reader = (
        (CheckpointFileWriter, CheckpointFileReader)
        if store == "file"
        else (OrbaxCheckpointWriter, OrbaxCheckpointReader)
    )
    with writer(output_dir=str(tmp_path)) as write:
        for checkpoint in tracking_loop(4):
            write(checkpoint)
    (resumed,) = tracking_loop(8, init=reader(dir=str(tmp_path), target=MODEL.init))
    assert resumed.step == 8
    same(resumed.carried, straight[-1].carried)
    same(resumed.model_params, straight[-1].model_params)


def test_several_steps_a_dispatch_carry_the_field_alike(straight):
    grouped = list(tracking_loop(8, steps_per_dispatch=4))
    for one, four in zip(straight, grouped):
        same(four.carried, one.carried)
        same(four.model_params, one.model_params)
