"""grain pipelines as training and evaluation data, resumed exactly through their own state."""

import jax
import numpy as np
import optax
import pytest

from flax_loop import CheckpointFileReader, CheckpointFileWriter, EvalLoop, EvalTask
from tests.helpers import (
    MLP,
    accuracy,
    assert_same_arrays,
    digits_loop,
    digits_split,
    file_names,
    resume_worker,
    run,
    slow,
)

grain = pytest.importorskip("grain")

X, Y, X_TEST, Y_TEST = digits_split()


def pipeline(x=X, y=Y, seed=0):
    """Shuffled digits in batches of 32: 46 batches an epoch, the partial one dropped."""
    return (
        grain.MapDataset.source(list(zip(x, y)))
        .shuffle(seed=seed)
        .map(lambda example: (example[0] * 2.0 - 1.0, example[1]))
        .batch(32, drop_remainder=True, batch_fn=lambda rows: tuple(map(np.stack, zip(*rows))))
        .to_iter_dataset()
    )


def loop(n_steps, **options):
    return digits_loop(
        optimizer=optax.adam(1e-2),
        data=pipeline(),
        n_steps=n_steps,
        n_steps_per_checkpoint=30,
        n_devices=1,
        **options,
    )


def test_a_grain_pipeline_resumes_bitwise_across_an_epoch_boundary(tmp_path):
    straight = list(loop(60))[-1]  # 60 steps: into the second epoch
    with CheckpointFileWriter(output_dir=str(tmp_path)) as writer:
        first = loop(30).next_checkpoint()
        writer(first)
    state = first.data_state["flax_loop/epoch"]
    assert state["epoch"] == 0 and state["batches"] == 30 and "state" in state  # grain's own
    resumed = loop(60, init=CheckpointFileReader(dir=str(tmp_path), target=MLP().init))
    assert resumed.step == 30
    ending = list(resumed)[-1]
    assert ending.data_state["flax_loop/epoch"]["epoch"] == 1
    for a, b in zip(jax.tree.leaves(ending.model_params), jax.tree.leaves(straight.model_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_grain_dataset_is_eval_data_read_whole_each_time():
    batches = (
        grain.MapDataset.source(list(zip(X_TEST, Y_TEST))).batch(
            64, batch_fn=lambda rows: tuple(map(np.stack, zip(*rows)))
        )  # 4 x 64 + 44
    )
    checkpoint = digits_loop(n_steps=5, n_devices=1).next_checkpoint()
    task = EvalTask(MLP().apply, {"accuracy": accuracy}, batches)
    evaluate = EvalLoop(task, rnkey=jax.random.key(1), n_steps=None)
    first, second = evaluate(checkpoint), evaluate(checkpoint)
    logits = MLP().apply({"params": checkpoint.model_params}, X_TEST)
    expected = float(np.mean(np.argmax(np.asarray(logits), -1) == Y_TEST))
    assert first.metrics["eval"]["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert second.metrics == first.metrics


@slow(
    "by default grain resumes bitwise in one process across an epoch, and in "
    "two processes each reading its own shard (tests/test_multiprocess.py)"
)
def test_a_pipeline_with_mp_prefetch_workers_resumes_bitwise(tmp_path):
    # Two grain worker processes prefetch the batches; the run is stopped at
    # step 20 (its newest file removed) and resumed. (Across epochs: above;
    # each epoch of an mp_prefetch pipeline starts its workers again, ~3 s.)
    directory, straight, resumed = tmp_path / "ckpts", tmp_path / "a.npz", tmp_path / "b.npz"
    options = ["--every", 20, "--keep", 2, "--devices", 1, "--grain-workers", 2]
    run(resume_worker(directory, 40, *options, "--out", straight))
    assert file_names(directory) == ["regular.20.ckpt", "regular.40.ckpt"]
    newest = CheckpointFileReader(dir=str(directory), target=None).read_newest()
    saved = newest.data_state["flax_loop/epoch"]
    assert (saved["epoch"], saved["batches"]) == (0, 40)
    assert "iterators_in_use_states" in saved["state"]  # mp_prefetch's own state
    (directory / "regular.40.ckpt").unlink()
    output = run(resume_worker(directory, 40, *options, "--out", resumed))
    assert "START 20" in output
    assert_same_arrays(straight, resumed)
