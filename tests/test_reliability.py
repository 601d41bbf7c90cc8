"""What an attacker found in 0.1.0, each reproduced and held now (issue: reliability, round 2)."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import optax
import pytest

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
)
from flax_loop.checkpoint import lock, parse
from flax_loop.errors import CheckpointError
from tests.flags import xla_flags
from tests.helpers import (
    MLP,
    ROOT,
    FlakyBatches,
    ResumableBatches,
    batches,
    digits_loop,
    digits_split,
    file_names,
    hand_trained,
    relative_difference,
)

X_TRAIN, Y_TRAIN, _, _ = digits_split()


class LiveStateBatches(ResumableBatches):
    """An iterator whose get_state returns its own live dict, as many do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state = {"position": 0}

    def __next__(self):
        batch = super().__next__()
        self.state["position"] = self.position
        return batch

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.position = int(state["position"])
        self.state = {"position": self.position}


def test_a_background_write_records_the_data_position_of_its_step(tmp_path):
    loop = digits_loop(
        data=LiveStateBatches(X_TRAIN, Y_TRAIN, 32), n_steps=20, n_steps_per_checkpoint=5
    )
    with CheckpointFileWriter(output_dir=str(tmp_path), keep=10, background=True) as writer:
        for checkpoint in loop:
            writer(checkpoint)
            assert checkpoint.data_state == {"position": checkpoint.step}
    for step in (5, 10, 15, 20):
        _, meta = parse.read(str(tmp_path / f"regular.{step}.ckpt"))
        assert meta["data_state"] == {"position": step}, step


def test_a_stop_request_during_the_body_ends_the_iteration_after_it(capsys):
    """The body sees each checkpoint once; the stop ends the process's
    training: a later loop (the fine-tuning after pre-training) trains no
    step and says why, until flax_loop.clear_stop()."""
    from flax_loop import clear_stop
    from flax_loop.errors import StoppedError

    loop = digits_loop(optimizer=optax.sgd(0.1), n_steps=30, n_steps_per_checkpoint=5)
    seen = []
    for checkpoint in loop:
        seen.append((checkpoint.step, checkpoint.n_completed_steps, checkpoint.preempted))
        if checkpoint.step == 10:
            signal.raise_signal(signal.SIGTERM)  # while the caller's body runs
    assert seen == [(5, 5, False), (10, 5, False)]
    assert loop.step == 10
    later = digits_loop(optimizer=optax.sgd(0.1), n_steps=30, n_steps_per_checkpoint=5, stdout=True)
    assert list(later) == [] and later.step == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "not training: this process was asked to stop (SIGTERM at step 10)" in said
    assert "flax_loop.clear_stop()" in said
    with pytest.raises(StoppedError, match=r"SIGTERM at step 10.*clear_stop"):
        loop.next_checkpoint()
    clear_stop()  # the documented way to train on
    assert loop.next_checkpoint().step == 15


def test_a_second_sigint_interrupts_at_once(capfd):
    # Python's own handler to come back to, whatever this worker process was
    # left with (a fresh-clone run once found SIGINT ignored here)
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        loop = digits_loop(optimizer=optax.sgd(0.1), n_steps=30, n_steps_per_checkpoint=5)
        with pytest.raises(KeyboardInterrupt):
            for checkpoint in loop:
                if checkpoint.step == 5:
                    signal.raise_signal(signal.SIGINT)
                    signal.raise_signal(signal.SIGINT)
        assert "press Ctrl-C again to stop at once" in capfd.readouterr().err
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, found)


def test_a_new_background_writer_per_checkpoint_loses_nothing(tmp_path):
    for checkpoint in hand_trained(60, 5):
        CheckpointFileWriter(output_dir=str(tmp_path), keep=12, background=True)(checkpoint)
    # Each writer lets go of the directory once its write is done: taking it
    # waits for the last one.
    held = lock.DirectoryLock(str(tmp_path), "regular.")
    held.acquire()
    held.release()
    assert file_names(tmp_path) == sorted(f"regular.{step}.ckpt" for step in range(5, 65, 5))


def test_a_second_writer_of_the_same_files_is_refused_naming_the_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "WAIT_SECONDS", 0.2)
    (checkpoint,) = hand_trained(2, 2)
    first = CheckpointFileWriter(output_dir=str(tmp_path))
    first(checkpoint)
    with pytest.raises(CheckpointError, match=f"process id {os.getpid()}"):
        CheckpointFileWriter(output_dir=str(tmp_path))(checkpoint)
    # Another kind of file (a best-metric writer) shares the directory freely.
    from flax_loop import LowestCheckpointFileWriter, Summary

    lowest = LowestCheckpointFileWriter(output_dir=str(tmp_path), metric="loss", stdout=False)
    lowest(Summary(metrics={"eval": {"loss": 0.5}}, **vars(checkpoint)))
    first.close()
    CheckpointFileWriter(output_dir=str(tmp_path))(checkpoint)  # free again


def test_a_background_write_that_fails_at_exit_exits_non_zero(tmp_path):
    program = textwrap.dedent(
        f"""
        import errno, jax
        from flax_loop.checkpoint import format
        from tests.helpers import digits_loop
        from flax_loop import CheckpointFileWriter

        checkpoint = digits_loop(n_steps=2, devices=jax.devices()[:1]).next_checkpoint()
        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        format.save = full_disk
        CheckpointFileWriter(output_dir={str(tmp_path)!r}, background=True)(checkpoint)
        # The writer is gone (made for one call) once its write has failed.
        import gc, time
        time.sleep(0.5)
        gc.collect()
        print("BODY DONE")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert "BODY DONE" in result.stdout
    assert result.returncode == 75, result.stdout + result.stderr
    assert "No space left on device" in result.stdout + result.stderr


def test_the_data_stream_raising_mid_interval_keeps_batches_and_statistics():
    def run(data):
        return digits_loop(
            data=data, optimizer=optax.sgd(0.1), n_steps=20, n_steps_per_checkpoint=10
        )

    straight = list(run(ResumableBatches(X_TRAIN, Y_TRAIN, 32)))
    loop = run(FlakyBatches(X_TRAIN, Y_TRAIN, 32, fail_at=16))
    first = loop.next_checkpoint()
    with pytest.raises(OSError, match="went away") as error:
        loop.next_checkpoint()
    assert any("batch for step 17" in note for note in error.value.__notes__)
    second = loop.next_checkpoint()  # the loop is still usable
    assert (first.step, second.step, second.n_completed_steps) == (10, 20, 10)
    assert second.mean_loss == pytest.approx(straight[1].mean_loss, rel=1e-6)
    assert relative_difference(second.model_params, straight[1].model_params) == 0.0


def test_an_unreadable_newest_file_is_an_error_not_a_fall_back(tmp_path):
    writer = CheckpointFileWriter(output_dir=str(tmp_path), keep=5)
    for checkpoint in digits_loop(n_steps=10, n_steps_per_checkpoint=5):
        writer(checkpoint)
    writer.close()
    os.rename(tmp_path / "regular.10.ckpt", tmp_path / "moved")
    os.mkdir(tmp_path / "regular.10.ckpt")  # reading it fails with an OS error
    with pytest.raises(CheckpointError, match="regular.10.ckpt cannot be read: .*Is a directory"):
        CheckpointFileReader(dir=str(tmp_path), target=None).read_newest()


def test_switching_nonfinite_mode_on_resume_keeps_the_optimizer_state(tmp_path):
    writer = CheckpointFileWriter(output_dir=str(tmp_path))
    for checkpoint in digits_loop(n_steps=5, n_steps_per_checkpoint=5, nonfinite="raise"):
        writer(checkpoint)
    writer.close()
    reader = CheckpointFileReader(dir=str(tmp_path), target=MLP().init)
    resumed = digits_loop(init=reader, n_steps=10, n_steps_per_checkpoint=5, nonfinite="skip")
    assert resumed.step == 5
    assert resumed.next_checkpoint().step == 10


def test_a_stored_key_that_differs_from_rnkey_is_said(tmp_path, capsys):
    writer = CheckpointFileWriter(output_dir=str(tmp_path))
    for checkpoint in digits_loop(n_steps=5, n_steps_per_checkpoint=5):
        writer(checkpoint)
    writer.close()
    reader = CheckpointFileReader(dir=str(tmp_path), target=MLP().init)
    digits_loop(init=reader, n_steps=10, rnkey=jax.random.key(7), stdout=True)
    assert "run key differs from rnkey" in capsys.readouterr().out


def test_jax_arrays_committed_to_one_device_are_accepted():
    device = jax.devices()[1]
    committed = (
        (jax.device_put(x, device), jax.device_put(y, device))
        for x, y in batches(X_TRAIN, Y_TRAIN, 32)
    )
    as_numpy = digits_loop(optimizer=optax.sgd(0.1), n_steps=6, n_steps_per_checkpoint=3)
    as_jax = digits_loop(
        data=committed, optimizer=optax.sgd(0.1), n_steps=6, n_steps_per_checkpoint=3
    )
    a, b = list(as_numpy)[-1], list(as_jax)[-1]
    assert relative_difference(a.model_params, b.model_params) < 1e-6


PIPED = """
import sys, jax, numpy as np, optax
import flax.linen as nn
from flax_loop import CheckpointFileWriter, SummaryLogger, TrainLoop, TrainTask

model = nn.Dense(3)
loss = lambda o, y: optax.softmax_cross_entropy_with_integer_labels(o, y).mean()
batch = (np.ones((8, 4), np.float32), np.zeros(8, np.int32))
loop = TrainLoop(init=model.init, task=TrainTask(model.apply, optax.sgd(0.1), loss, [batch]),
                 rnkey=jax.random.key(0), n_steps=40, n_steps_per_checkpoint=4)
write, log = CheckpointFileWriter(output_dir=sys.argv[1], keep=20), SummaryLogger()
for checkpoint in loop:
    write(log(checkpoint))
"""


def test_a_console_that_went_away_does_not_end_training(tmp_path):
    """`python train.py | head -1`: the reader leaves after one line; the run
    trains to its end and writes every file, exit status 0."""
    process = subprocess.Popen(
        [sys.executable, "-c", PIPED, str(tmp_path / "ckpts")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
        env={**os.environ, "XLA_FLAGS": xla_flags(1)},
    )  # fmt: skip
    assert process.stdout.readline().startswith(b"Model:")
    process.stdout.close()  # as `head -1` does
    _, errors = process.communicate(timeout=120)
    assert process.returncode == 0, errors.decode()
    assert (tmp_path / "ckpts" / "regular.40.ckpt").exists()
