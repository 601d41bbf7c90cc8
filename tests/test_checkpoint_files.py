"""Checkpoint files: format, atomicity, damage, keep-N, best metrics, resume.

The writers and readers are tested on checkpoints of a hand-written loop
(`hand_trained`); resuming a `TrainLoop` from them needs the loop."""

import os

import jax
import numpy as np
import optax
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
from flax_loop.checkpoint import checksums, format, parse
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
    batches,
    digits_loop,
    digits_split,
    directory_bytes,
    file_names,
    hand_trained,
    resume_worker,
    run,
    slow,
)

X_TRAIN, Y_TRAIN, _, _ = digits_split()


def make_loop(init=None, n_devices=1, features=(64,), **options):
    model = MLP(features=features)
    options.setdefault("n_steps_per_checkpoint", 5)
    return digits_loop(model, n_devices=n_devices, init=init or model.init, **options)


def files(directory):
    return file_names(directory)


def assert_trees_equal(a, b):
    jax.tree.map(
        np.testing.assert_array_equal, jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b)
    )


def initializer_of(checkpoint):
    return CheckpointFile(
        model_params=checkpoint.model_params,
        model_state={},
        optimizer_state=checkpoint.optimizer_state,
        step=0,
    )


def test_round_trip_and_keep_two(tmp_path):
    writer = CheckpointFileWriter(output_dir=str(tmp_path), keep=2)
    checkpoints = [writer(c) for c in hand_trained(20, 5)]
    assert [c.step for c in checkpoints] == [5, 10, 15, 20]
    assert files(tmp_path) == ["regular.15.ckpt", "regular.20.ckpt"]
    last = checkpoints[-1]
    restored = CheckpointFileReader(dir=str(tmp_path), target=None)(initializer_of(last))
    assert restored.step == 20
    assert_trees_equal(restored.model_params, last.model_params)
    assert_trees_equal(restored.optimizer_state, last.optimizer_state)
    assert type(restored.optimizer_state[0]).__name__ == "ScaleByAdamState"
    assert int(restored.optimizer_state[0].count) == 20


def test_writer_returns_its_input_and_summary_metrics_are_stored(tmp_path):
    (checkpoint,) = hand_trained(5, 5)
    summary = Summary(metrics={"eval": {"accuracy": 0.5}}, **vars(checkpoint))
    writer = CheckpointFileWriter(output_dir=str(tmp_path))
    assert writer(summary) is summary
    raw = CheckpointFileReader(dir=str(tmp_path), target=None).read_newest()
    assert raw.metrics == {"eval": {"accuracy": 0.5}}
    assert raw.step == 5


def _three_files(tmp_path):
    writer = CheckpointFileWriter(output_dir=str(tmp_path), keep=3)
    return [writer(c) for c in hand_trained(15, 5)]


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as stream:
        stream.truncate(size // 2)


def _flip_array_byte(path):
    _, meta = parse.read(path)
    with open(path, "rb") as stream:
        data = bytearray(stream.read())
    # Flip a byte in the middle of the data region (inside an array).
    data[format.HEAD.size + 1000] ^= 0x40
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
    checkpoints = _three_files(tmp_path)
    damage(str(tmp_path / "regular.15.ckpt"))
    restored = CheckpointFileReader(dir=str(tmp_path), target=None)(initializer_of(checkpoints[-1]))
    assert restored.step == 10
    assert_trees_equal(restored.model_params, checkpoints[1].model_params)
    out = " ".join(capsys.readouterr().out.split())
    assert "regular.15.ckpt" in out and reason in out


def test_every_file_damaged_raises_and_deletes_nothing(tmp_path):
    checkpoints = _three_files(tmp_path)
    for name in files(tmp_path):
        _flip_array_byte(str(tmp_path / name))
    before = {name: open(tmp_path / name, "rb").read() for name in files(tmp_path)}
    with pytest.raises(CheckpointCorruptError, match="Every checkpoint file"):
        CheckpointFileReader(dir=str(tmp_path), target=None)(initializer_of(checkpoints[-1]))
    after = {name: open(tmp_path / name, "rb").read() for name in files(tmp_path)}
    assert before == after


def test_leftover_temporary_file_is_ignored_then_cleaned(tmp_path):
    checkpoints = _three_files(tmp_path)
    leftover = tmp_path / ".tmp.regular.20.ckpt.0badc0de"
    leftover.write_bytes(b"half a checkpoint")
    restored = CheckpointFileReader(dir=str(tmp_path), target=None)(initializer_of(checkpoints[-1]))
    assert restored.step == 15
    CheckpointFileWriter(output_dir=str(tmp_path), keep=3)(checkpoints[-1])
    assert not leftover.exists()
    assert files(tmp_path) == ["regular.10.ckpt", "regular.15.ckpt", "regular.5.ckpt"]


def test_newer_format_version_is_a_clear_error(tmp_path):
    checkpoints = _three_files(tmp_path)
    path = tmp_path / "regular.15.ckpt"
    with open(path, "r+b") as stream:
        stream.seek(8)
        stream.write((format.FORMAT_VERSION + 1).to_bytes(4, "little"))
    with pytest.raises(CheckpointVersionError, match="format version 2"):
        CheckpointFileReader(dir=str(tmp_path), target=None)(initializer_of(checkpoints[-1]))


def test_checkpoint_of_another_model_lists_the_differences(tmp_path):
    _three_files(tmp_path)
    (other,) = hand_trained(1, 1, model=MLP(features=(32,)))
    with pytest.raises(CheckpointMismatchError) as error:
        CheckpointFileReader(dir=str(tmp_path), target=None)(initializer_of(other))
    message = str(error.value)
    assert "/model_params/Dense_0/kernel: model float32[64, 32], file float32[64, 64]" in message
    assert "regular.15.ckpt" in message


def test_four_device_file_resumes_on_one_device(tmp_path):
    four = make_loop(n_devices=4, n_steps=10)
    writer = CheckpointFileWriter(output_dir=str(tmp_path))
    last = [writer(c) for c in four][-1]
    reader = CheckpointFileReader(dir=str(tmp_path), target=MLP().init)
    # Adam with a learning rate of 0: the same state, and a step that keeps the params.
    one = make_loop(init=reader, optimizer=optax.adam(0.0), n_steps=15, n_devices=1)
    assert one.step == 10 and len(one.devices) == 1
    after = one.next_step()
    assert after.step == 11
    assert_trees_equal(after.model_params, last.model_params)
    assert int(after.optimizer_state[0].count) == 11


def test_a_fresh_run_never_deletes_a_longer_runs_files_unless_asked(tmp_path):
    checkpoints = _three_files(tmp_path)
    before = directory_bytes(tmp_path)
    for overwrite in (None, False):  # the default, and the strict mode
        with pytest.raises(CheckpointError) as error:
            CheckpointFileWriter(output_dir=str(tmp_path), overwrite=overwrite)(checkpoints[0])
        message = str(error.value)
        assert "step 5" in message and "regular.15.ckpt of step 15" in message
        assert "CheckpointFileReader" in message and "overwrite=True" in message
        assert directory_bytes(tmp_path) == before
    CheckpointFileWriter(output_dir=str(tmp_path), keep=3, overwrite=True)(checkpoints[0])
    assert files(tmp_path) == ["regular.5.ckpt"]


def test_the_same_step_is_replaced_by_default_but_not_with_overwrite_false(tmp_path):
    checkpoints = _three_files(tmp_path)
    with pytest.raises(CheckpointError, match="regular.15.ckpt of step 15"):
        CheckpointFileWriter(output_dir=str(tmp_path), keep=3, overwrite=False)(checkpoints[-1])
    CheckpointFileWriter(output_dir=str(tmp_path), keep=3)(checkpoints[-1])
    assert files(tmp_path) == ["regular.10.ckpt", "regular.15.ckpt", "regular.5.ckpt"]


def _summary(checkpoint, **eval_metrics):
    return Summary(metrics={"eval": eval_metrics}, **vars(checkpoint))


def test_best_metric_writers_keep_the_right_file_across_a_restart(tmp_path):
    checkpoints = hand_trained(25, 5)
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
    initializer = initializer_of(checkpoints[0])
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
    (checkpoint,) = hand_trained(5, 5)
    writer = HighestCheckpointFileWriter(output_dir=str(tmp_path), metric="acc", stdout=False)
    with pytest.raises(MetricError, match=r"eval/acc .*\['accuracy'\]"):
        writer(_summary(checkpoint, accuracy=1.0))
    assert files(tmp_path) == []


def run_worker(directory, n_steps, *args, devices=4):
    return run(resume_worker(directory, n_steps, "--devices", devices, *args))


@slow(
    "by default a new process resumes bit for bit after a SIGTERM (tests/test_preemption.py) "
    "and after SIGKILLs (tests/test_crash.py), from the same worker's files"
)
def test_resume_in_a_new_process_is_bitwise_exact(tmp_path):
    first = run_worker(tmp_path / "straight", 30, "--keep", 3, "--out", tmp_path / "straight.npz")
    assert "WROTE 10" in first and "DONE 30" in first
    # The straight run's step-10 file, as a run stopped there would have left it.
    import shutil

    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    for step in (20, 30):
        os.remove(tmp_path / "resumed" / f"regular.{step}.ckpt")
    second = run_worker(tmp_path / "resumed", 30, "--out", tmp_path / "resumed.npz")
    assert "Resumed from step 10" in " ".join(second.split())
    assert "START 10" in second and "WROTE 30" in second
    assert "batch_stats/BatchNorm_0/mean" in np.load(tmp_path / "straight.npz").files
    assert_same_arrays(tmp_path / "straight.npz", tmp_path / "resumed.npz")


def test_plain_stream_resume_says_it_restarts_from_its_first_batch(tmp_path, capsys):
    x, y, _, _ = digits_split()
    with CheckpointFileWriter(output_dir=str(tmp_path)) as writer:
        writer(
            digits_loop(
                data=batches(x, y, 32), n_steps=10, n_steps_per_checkpoint=10
            ).next_checkpoint()
        )
    capsys.readouterr()
    resumed = digits_loop(
        data=batches(x, y, 32),  # a plain generator: no get_state/set_state
        init=CheckpointFileReader(dir=str(tmp_path), target=MLP().init),
        n_steps=20,
        stdout=True,
    )
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("it has no get_state/set_state): it restarts from its first batch") == 1
    assert "will not match one that never stopped" in out
    assert resumed.step == 10 and list(resumed)[-1].step == 20


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
    raw = CheckpointFileReader(dir=str(tmp_path), target=None).read_newest()
    np.testing.assert_array_equal(
        raw.model_params["layer3"], np.full((leaf // 4,), 3.0, np.float32)
    )


def test_checksums_of_small_arrays_here_and_of_large_ones_on_a_thread_agree_with_crc32():
    """A file's small arrays are summed where they are read, a full chunk
    starts the summing thread and those after it go to the thread too: each
    array's checksum is its own, in any mix."""
    import threading
    import zlib

    rng = np.random.default_rng(0)
    arrays = [rng.bytes(n) for n in (12, 3 * 1000, checksums.CHUNK, 7, checksums.CHUNK + 5, 1)]
    with checksums.Checksums() as summing:
        sums = []
        for data in arrays:
            view = memoryview(data)
            for start in range(0, len(data), checksums.CHUNK):
                summing.add(view[start : start + checksums.CHUNK])
                if data is arrays[1]:  # small ones so far: no thread
                    assert not any(t.name == "flax_loop-crc32" for t in threading.enumerate())
            sums.append(summing.result())
    assert sums == [zlib.crc32(data) for data in arrays]
