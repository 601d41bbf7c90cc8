"""Background checkpoint writes: same files, errors surface, nothing races or is lost."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from flax_loop import CheckpointFileReader, CheckpointFileWriter
from flax_loop.checkpoint import format
from flax_loop.errors import CheckpointError
from tests.flags import xla_flags
from tests.helpers import ROOT, directory_bytes, file_names, hand_trained


@pytest.fixture(scope="module")
def checkpoints():
    return hand_trained(20, 5)


def test_background_files_equal_foreground_files(tmp_path, checkpoints):
    with CheckpointFileWriter(output_dir=str(tmp_path / "bg"), keep=2, background=True) as writer:
        for checkpoint in checkpoints:
            assert writer(checkpoint) is checkpoint
    foreground = CheckpointFileWriter(output_dir=str(tmp_path / "fg"), keep=2)
    for checkpoint in checkpoints:
        foreground(checkpoint)
    assert directory_bytes(tmp_path / "bg") == directory_bytes(tmp_path / "fg")
    assert sorted(directory_bytes(tmp_path / "bg")) == ["regular.15.ckpt", "regular.20.ckpt"]


def test_the_next_write_waits_for_the_previous_one(tmp_path, checkpoints, monkeypatch):
    save, order, running = format.save, [], threading.Event()

    def slow_save(directory, prefix, file, fsync=True):
        assert not running.is_set(), "two writes overlapped"
        running.set()
        time.sleep(1.0)
        order.append(file.step)
        try:
            return save(directory, prefix, file, fsync)
        finally:
            running.clear()

    monkeypatch.setattr(format, "save", slow_save)
    writer = CheckpointFileWriter(output_dir=str(tmp_path), keep=3, background=True)
    writer(checkpoints[0])
    assert order == []  # the caller did not wait for the 1 s write (still under way)
    writer(checkpoints[1])  # waits for the first, then returns at once
    writer.close()
    assert order == [5, 10]
    assert file_names(tmp_path) == ["regular.10.ckpt", "regular.5.ckpt"]


def test_a_failed_background_write_raises_at_the_next_write_and_at_wait(
    tmp_path, checkpoints, monkeypatch
):
    writer = CheckpointFileWriter(output_dir=str(tmp_path), background=True)
    writer(checkpoints[0])
    writer.wait()
    before = directory_bytes(tmp_path)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("flax_loop.checkpoint.format.write", full_disk)
    writer(checkpoints[1])  # accepted; fails on the worker thread
    with pytest.raises(CheckpointError, match="No space left on device"):
        writer(checkpoints[2])
    assert directory_bytes(tmp_path) == before
    writer(checkpoints[3])
    with pytest.raises(CheckpointError, match="step 20 .* No space left"):
        writer.wait()
    monkeypatch.undo()
    writer.close()
    assert directory_bytes(tmp_path) == before
    assert CheckpointFileReader(dir=str(tmp_path), target=None).read_newest().step == 5


def test_pending_writes_finish_at_interpreter_exit(tmp_path):
    program = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        import jax, optax
        from flax_loop import CheckpointFileWriter, TrainLoop, TrainTask
        from flax_loop.checkpoint import format
        from tests.helpers import MLP, batches, cross_entropy, digits_split

        save = format.save
        def slow_save(*args, **kwargs):
            time.sleep(1.0)
            return save(*args, **kwargs)
        format.save = slow_save

        x, y, _, _ = digits_split()
        model = MLP()
        loop = TrainLoop(init=model.init, rnkey=jax.random.key(0), n_steps=5, n_steps_per_checkpoint=5,
                         task=TrainTask(model.apply, optax.adam(1e-2), cross_entropy, batches(x, y, 32)), stdout=False)
        writer = CheckpointFileWriter(output_dir={str(tmp_path)!r}, background=True)
        for checkpoint in loop:
            writer(checkpoint)
        print("LEAVING", flush=True)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XLA_FLAGS": xla_flags(1)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "LEAVING" in result.stdout
    assert file_names(tmp_path) == ["regular.5.ckpt"]
    assert CheckpointFileReader(dir=str(tmp_path), target=None).read_newest().step == 5
