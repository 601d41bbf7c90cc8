"""Checkpoint files: format, atomicity, damage, keep-N, best metrics, resume."""

import os

import jax
import numpy as np
import pytest

from flax_loop import (
    CheckpointFile,
    CheckpointFileReader,
    CheckpointFileWriter,
    HighestCheckpointFileReader,
    HighestCheckpointFileWriter,
    LowestCheckpointFileReader,
    LowestCheckpointFileWriter,
    Summary,
)
from flax_loop.checkpoint import _format
from flax_loop.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointVersionError,
    MetricError,
)
from tests.helpers import (
    MLP,
    assert_same_arrays,
    digits_loop,
    digits_split,
    resume_worker,
    run,
)

X_TRAIN, Y_TRAIN, _, _ = digits_split()


def make_loop(init=None, n_devices=1, features=(64,), **options):
    model = MLP(features=features)
    options.setdefault("n_steps_per_checkpoint", 5)
    return digits_loop(model, n_devices=n_devices, init=init or model.init, **options)


def files(directory):
    return sorted(name for name in os.listdir(directory))


def assert_trees_equal(a, b):
    jax.tree.map(
        np.testing.assert_array_equal, jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b)
    )


def initializer_of(loop_params, loop):
    return CheckpointFile(
        model_params=loop_params,
        model_state={},
        optimizer_state=loop._state.optimizer_state,
        step=0,
    )


def test_round_trip_and_keep_two(tmp_path):
    loop = make_loop(n_steps=20)
    writer = CheckpointFileWriter(output_dir=str(tmp_path), keep=2)
    checkpoints = [writer(c) for c in loop]
    assert [c.step for c in checkpoints] == [5, 10, 15, 20]
    assert files(tmp_path) == ["regular.15.ckpt", "regular.20.ckpt"]
    last = checkpoints[-1]
    restored = CheckpointFileReader(dir=str(tmp_path), target=None)(
        initializer_of(last.model_params, loop)
    )
    assert restored.step == 20
    assert_trees_equal(restored.model_params, last.model_params)
    assert_trees_equal(restored.optimizer_state, last.optimizer_state)
    assert type(restored.optimizer_state[0]).__name__ == "ScaleByAdamState"
    assert int(restored.optimizer_state[0].count) == 20


def test_writer_returns_its_input_and_summary_metrics_are_stored(tmp_path):
    checkpoint = make_loop(n_steps=5).next_checkpoint()
    summary = Summary(metrics={"eval": {"accuracy": 0.5}}, **vars(checkpoint))
    writer = CheckpointFileWriter(output_dir=str(tmp_path))
    assert writer(summary) is summary
    raw = CheckpointFileReader(dir=str(tmp_path), target=None).read(None)
    assert raw["metrics"] == {"eval": {"accuracy": 0.5}}
    assert raw["step"] == 5


def _three_files(tmp_path):
    loop = make_loop(n_steps=15)
    writer = CheckpointFileWriter(output_dir=str(tmp_path), keep=3)
    checkpoints = [writer(c) for c in loop]
    return loop, checkpoints


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as stream:
        stream.truncate(size // 2)


def _flip_array_byte(path):
    _, meta = _format.read(path)
    with open(path, "rb") as stream:
        data = bytearray(stream.read())
    # Flip a byte in the middle of the data region (inside an array).
    data[_format._HEAD.size + 1000] ^= 0x40
    with open(path, "wb") as stream:
        stream.write(data)


def _garbage_header(path):
    with open(path, "r+b") as stream:
        stream.write(b"GARBAGE!")


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_truncate, "truncated"),
        (_flip_array_byte, "checksum"),
        (_garbage_header, "not a flax_loop"),
    ],
    ids=["truncated", "flipped-byte", "garbage-header"],
)
def test_damaged_newest_file_falls_back_to_previous(tmp_path, damage, reason, capsys):
    from flax_loop import console

    console._console = None
    loop, checkpoints = _three_files(tmp_path)
    damage(str(tmp_path / "regular.15.ckpt"))
    restored = CheckpointFileReader(dir=str(tmp_path), target=None)(
        initializer_of(checkpoints[-1].model_params, loop)
    )
    assert restored.step == 10
    assert_trees_equal(restored.model_params, checkpoints[1].model_params)
    out = " ".join(capsys.readouterr().out.split())
    assert "regular.15.ckpt" in out and reason in out
    console._console = None


def test_every_file_damaged_raises_and_deletes_nothing(tmp_path):
    loop, checkpoints = _three_files(tmp_path)
    for name in files(tmp_path):
        _flip_array_byte(str(tmp_path / name))
    before = {name: open(tmp_path / name, "rb").read() for name in files(tmp_path)}
    with pytest.raises(CheckpointCorruptError, match="Every checkpoint file"):
        make_loop(init=CheckpointFileReader(dir=str(tmp_path), target=MLP().init), n_steps=20)
    after = {name: open(tmp_path / name, "rb").read() for name in files(tmp_path)}
    assert before == after


def test_leftover_temporary_file_is_ignored_then_cleaned(tmp_path):
    loop, checkpoints = _three_files(tmp_path)
    leftover = tmp_path / ".tmp.regular.20.ckpt.0badc0de"
    leftover.write_bytes(b"half a checkpoint")
    restored = CheckpointFileReader(dir=str(tmp_path), target=None)(
        initializer_of(checkpoints[-1].model_params, loop)
    )
    assert restored.step == 15
    CheckpointFileWriter(output_dir=str(tmp_path), keep=3)(checkpoints[-1])
    assert not leftover.exists()
    assert files(tmp_path) == ["regular.10.ckpt", "regular.15.ckpt", "regular.5.ckpt"]


def test_newer_format_version_is_a_clear_error(tmp_path):
    loop, checkpoints = _three_files(tmp_path)
    path = tmp_path / "regular.15.ckpt"
    with open(path, "r+b") as stream:
        stream.seek(8)
        stream.write((_format.FORMAT_VERSION + 1).to_bytes(4, "little"))
    with pytest.raises(CheckpointVersionError, match="format version 2"):
        CheckpointFileReader(dir=str(tmp_path), target=None)(
            initializer_of(checkpoints[-1].model_params, loop)
        )


def test_checkpoint_of_another_model_lists_the_differences(tmp_path):
    _three_files(tmp_path)
    reader = CheckpointFileReader(dir=str(tmp_path), target=MLP(features=(32,)).init)
    with pytest.raises(CheckpointMismatchError) as error:
        make_loop(init=reader, features=(32,), n_steps=20)
    message = str(error.value)
    assert "/model_params/Dense_0/kernel: model (64, 32), file (64, 64)" in message
    assert "regular.15.ckpt" in message


def test_four_device_file_resumes_on_one_device(tmp_path):
    four = make_loop(n_devices=4, n_steps=10)
    writer = CheckpointFileWriter(output_dir=str(tmp_path))
    last = [writer(c) for c in four][-1]
    one = make_loop(init=CheckpointFileReader(dir=str(tmp_path), target=MLP().init), n_steps=15)
    assert one.step == 10 and one._placement.n_devices == 1
    assert_trees_equal(one._state.model_params, last.model_params)
    (checkpoint,) = list(one)
    assert checkpoint.step == 15


def test_overwrite_false_refuses_a_later_file(tmp_path):
    loop, checkpoints = _three_files(tmp_path)
    with pytest.raises(CheckpointError, match="overwrite=True"):
        CheckpointFileWriter(output_dir=str(tmp_path), overwrite=False)(checkpoints[0])
    CheckpointFileWriter(output_dir=str(tmp_path), keep=3)(checkpoints[0])
    assert files(tmp_path) == ["regular.5.ckpt"]


def _summary(checkpoint, **eval_metrics):
    return Summary(metrics={"eval": eval_metrics}, **vars(checkpoint))


def test_best_metric_writers_keep_the_right_file_across_a_restart(tmp_path):
    loop = make_loop(n_steps=25)
    checkpoints = list(loop)
    accuracies = [0.5, 0.7, 0.6, 0.0, 0.65]
    losses = [0.9, 0.0, 0.3, 0.5, 0.2]  # a best of 0.0 is a value
    directory = str(tmp_path)
    highest = HighestCheckpointFileWriter(output_dir=directory, metric="accuracy", stdout=False)
    lowest = LowestCheckpointFileWriter(output_dir=directory, metric="loss", stdout=False)
    longer = LowestCheckpointFileWriter(output_dir=directory, metric="loss_sum", stdout=False)
    for checkpoint, acc, loss in list(zip(checkpoints, accuracies, losses))[:3]:
        summary = _summary(checkpoint, accuracy=acc, loss=loss, loss_sum=loss + 1)
        assert lowest(longer(highest(summary))) is summary
    assert files(tmp_path) == [
        "highest.eval.accuracy.10.ckpt",
        "lowest.eval.loss.10.ckpt",
        "lowest.eval.loss_sum.10.ckpt",
    ]
    # A restart: new writers read the best values back from their files.
    highest = HighestCheckpointFileWriter(output_dir=directory, metric="accuracy", stdout=False)
    lowest = LowestCheckpointFileWriter(output_dir=directory, metric="loss", stdout=False)
    assert highest.best_metric == 0.7 and lowest.best_metric == 0.0
    for checkpoint, acc, loss in list(zip(checkpoints, accuracies, losses))[3:]:
        lowest(highest(_summary(checkpoint, accuracy=acc, loss=loss)))
    assert files(tmp_path) == [
        "highest.eval.accuracy.10.ckpt",
        "lowest.eval.loss.10.ckpt",
        "lowest.eval.loss_sum.10.ckpt",
    ]
    initializer = initializer_of(checkpoints[0].model_params, loop)
    best = HighestCheckpointFileReader(dir=directory, target=None, metric="accuracy")(initializer)
    assert best.step == 10 and best.metrics["eval"]["accuracy"] == 0.7
    assert_trees_equal(best.model_params, checkpoints[1].model_params)
    lowest_file = LowestCheckpointFileReader(dir=directory, target=None, metric="loss")(initializer)
    assert lowest_file.step == 10
    # Only "loss" files match "loss", not "loss_sum" ones, and vice versa.
    assert (
        LowestCheckpointFileReader(dir=directory, target=None, metric="loss_sum")(
            initializer
        ).metrics["eval"]["loss_sum"]
        == 1.0
    )


def test_best_writer_names_a_missing_metric(tmp_path):
    checkpoint = make_loop(n_steps=5).next_checkpoint()
    writer = HighestCheckpointFileWriter(output_dir=str(tmp_path), metric="acc", stdout=False)
    with pytest.raises(MetricError, match=r"eval/acc .*\['accuracy'\]"):
        writer(_summary(checkpoint, accuracy=1.0))
    assert files(tmp_path) == []


def run_worker(directory, n_steps, *args, devices=4):
    return run(resume_worker(directory, n_steps, "--devices", devices, *args))


def test_resume_in_a_new_process_is_bitwise_exact(tmp_path):
    run_worker(tmp_path / "straight", 30, "--out", tmp_path / "straight.npz")
    first = run_worker(tmp_path / "resumed", 10)
    assert "WROTE 10" in first and "DONE 10" in first
    second = run_worker(tmp_path / "resumed", 30, "--out", tmp_path / "resumed.npz")
    assert "Resumed from step 10" in " ".join(second.split())
    assert "START 10" in second and "WROTE 30" in second
    assert "batch_stats/BatchNorm_0/mean" in np.load(tmp_path / "straight.npz").files
    assert_same_arrays(tmp_path / "straight.npz", tmp_path / "resumed.npz")


def test_plain_stream_resume_says_it_continues_from_its_position(tmp_path):
    run_worker(tmp_path, 10, "--plain-stream", devices=1)
    out = " ".join(run_worker(tmp_path, 20, "--plain-stream", devices=1).split())
    assert out.count("continues from its current position") == 1
    assert "DONE 20" in out


def test_writing_holds_at_most_one_array_beyond_the_state(tmp_path):
    import tracemalloc

    from flax_loop import Checkpoint

    leaf = 16 << 20  # 16 MiB per array, 64 MiB of parameters
    params = {
        f"layer{i}": jax.numpy.full((leaf // 4,), float(i), jax.numpy.float32) for i in range(4)
    }
    checkpoint = Checkpoint(params, {}, {}, {}, 0.0, 1, 0.0, 1)
    jax.block_until_ready(params)
    tracemalloc.start()
    try:
        CheckpointFileWriter(output_dir=str(tmp_path))(checkpoint)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.25 * leaf, f"peak {peak / 2**20:.1f} MiB while writing"
    raw = CheckpointFileReader(dir=str(tmp_path), target=None).read(None)
    np.testing.assert_array_equal(
        raw["model_params"]["layer3"], np.full((leaf // 4,), 3.0, np.float32)
    )
