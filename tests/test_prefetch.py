"""Prefetch: a background thread reads batches ahead; checkpoints stay exact."""

import signal
import threading
import time

import numpy as np
import optax
import pytest

from flax_loop import CheckpointFileReader, CheckpointFileWriter, clear_stop
from flax_loop.data.readahead import PROBE_READS
from flax_loop.errors import ConfigError
from tests.helpers import (
    MLP,
    FlakyBatches,
    ResumableBatches,
    digits_loop,
    digits_split,
    relative_difference,
)

X_TRAIN, Y_TRAIN, _, _ = digits_split()


class Recorded(ResumableBatches):
    """Records the thread of each read; optionally waits `delay` per batch."""

    def __init__(self, *args, delay=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay, self.threads = delay, []

    def __next__(self):
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        return super().__next__()


class InMemory:
    """Batches held in memory, read in a few microseconds each."""

    def __init__(self, batches):
        self.batches, self.position, self.threads = batches, 0, []

    def __iter__(self):
        return self

    def __next__(self):
        self.threads.append(threading.current_thread().name)
        batch = self.batches[self.position % len(self.batches)]
        self.position += 1
        return batch


def prefetch_threads():
    return [thread for thread in threading.enumerate() if thread.name == "flax_loop-prefetch"]


def threads_left(seconds=5.0):
    """The reading threads still alive after `seconds` at most: a stopped
    thread ends after its read in progress (a stop never waits for it)."""
    deadline = time.monotonic() + seconds
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return prefetch_threads()


def params_of(checkpoint):
    return checkpoint.model_params


def test_a_thread_reading_ahead_saves_the_state_of_the_last_trained_batch(tmp_path):
    source = Recorded(X_TRAIN, Y_TRAIN, 32)
    loop = digits_loop(data=source, n_steps=10, n_steps_per_checkpoint=5, prefetch=4)
    writer = CheckpointFileWriter(output_dir=str(tmp_path), keep=5)
    straight = []
    for checkpoint in loop:
        time.sleep(0.2)  # the thread fills its buffer meanwhile
        # read ahead of training, never past the last step (10)
        assert source.position >= min(checkpoint.step + 4, 10)
        assert checkpoint.data_state == {"position": checkpoint.step}
        writer(checkpoint)
        straight.append(checkpoint)
    writer.close()
    assert source.threads[0] == "MainThread"  # the first batch, read at set-up
    assert set(source.threads[1:]) == {"flax_loop-prefetch"}
    assert threads_left() == []
    (tmp_path / "regular.10.ckpt").unlink()  # resume from step 5
    resumed = digits_loop(
        init=CheckpointFileReader(dir=str(tmp_path), target=MLP().init),
        data=Recorded(X_TRAIN, Y_TRAIN, 32),
        n_steps=10,
        n_steps_per_checkpoint=5,
        prefetch=4,
    )
    assert resumed.step == 5
    (last,) = list(resumed)
    assert relative_difference(last.model_params, straight[-1].model_params) == 0.0
    assert last.data_state == {"position": 10}


def test_a_prefetched_list_resumes_exactly_across_epochs(tmp_path):
    data = [(X_TRAIN[i * 32 : (i + 1) * 32], Y_TRAIN[i * 32 : (i + 1) * 32]) for i in range(7)]

    def run(**options):
        return digits_loop(data=data, n_steps_per_checkpoint=5, prefetch=3, **options)

    writer = CheckpointFileWriter(output_dir=str(tmp_path), keep=5)
    straight = []
    for checkpoint in run(n_steps=15):
        writer(checkpoint)
        straight.append(checkpoint)
    writer.close()
    states = [c.data_state["flax_loop/epoch"] for c in straight]
    assert states == [
        {"epoch": 0, "batches": 5},
        {"epoch": 1, "batches": 3},
        {"epoch": 2, "batches": 1},
    ]
    inline = list(digits_loop(data=data, n_steps=15, n_steps_per_checkpoint=5, prefetch=0))
    assert relative_difference(inline[-1].model_params, straight[-1].model_params) == 0.0
    (tmp_path / "regular.15.ckpt").unlink()  # resume from step 10, in the second epoch
    resumed = run(init=CheckpointFileReader(dir=str(tmp_path), target=MLP().init), n_steps=15)
    assert resumed.step == 10
    (last,) = list(resumed)
    assert relative_difference(last.model_params, straight[-1].model_params) == 0.0


def test_an_error_on_the_thread_is_raised_in_the_caller_with_its_step():
    def run(data):
        return digits_loop(
            data=data, optimizer=optax.sgd(0.1), n_steps=20, n_steps_per_checkpoint=10, prefetch=3
        )

    straight = list(run(ResumableBatches(X_TRAIN, Y_TRAIN, 32)))
    source = FlakyBatches(X_TRAIN, Y_TRAIN, 32, fail_at=16)
    loop = run(source)
    first = loop.next_checkpoint()
    with pytest.raises(OSError, match="went away") as error:
        loop.next_checkpoint()
    assert any("batch for step 17" in note for note in error.value.__notes__)
    assert threads_left() == []
    second = loop.next_checkpoint()  # the loop is still usable, nothing read is lost
    assert (first.step, second.step, second.n_completed_steps) == (10, 20, 10)
    assert second.mean_loss == pytest.approx(straight[1].mean_loss, rel=1e-6)
    assert relative_difference(second.model_params, straight[1].model_params) == 0.0
    assert "flax_loop-prefetch" in source.threads


def test_no_reading_thread_outlives_the_end_a_break_a_stop_or_exhaustion():
    loop = digits_loop(data=Recorded(X_TRAIN, Y_TRAIN, 32), n_steps=6, prefetch=2)
    for checkpoint in loop:
        if checkpoint.step <= 3:  # reading while the caller works (it stops after step 6)
            assert len(prefetch_threads()) == 1
    assert threads_left() == []
    loop = digits_loop(data=Recorded(X_TRAIN, Y_TRAIN, 32), n_steps=6, prefetch=2)
    for _checkpoint in loop:
        break
    assert threads_left() == []
    stops = []
    loop = digits_loop(data=Recorded(X_TRAIN, Y_TRAIN, 32), n_steps=50, prefetch=2)
    for checkpoint in loop:
        stops.append((checkpoint.step, checkpoint.preempted))
        if checkpoint.step == 3:
            signal.raise_signal(signal.SIGTERM)  # the loop's handler: a stop request
    assert stops[-1] == (3, False) and len(stops) == 3  # the body's was the last
    assert threads_left() == []
    clear_stop()  # the stop ended the process's training: train on
    short = iter([(X_TRAIN[:32], Y_TRAIN[:32])] * 7)
    loop = digits_loop(data=short, n_steps=10, n_steps_per_checkpoint=5, prefetch=2)
    assert [checkpoint.step for checkpoint in loop] == [5, 7]
    assert threads_left() == []


class MainThreadOnly(ResumableBatches):
    """A source tied to the thread that made it (as sqlite3 connections are)."""

    def __next__(self):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("objects created in a thread can only be used in that thread")
        return super().__next__()


def test_a_source_that_cannot_be_read_from_a_thread_is_read_inline(capsys):
    inline = list(digits_loop(data=ResumableBatches(X_TRAIN, Y_TRAIN, 32), n_steps=8, prefetch=0))
    loop = digits_loop(data=MainThreadOnly(X_TRAIN, Y_TRAIN, 32), n_steps=8, prefetch=2)
    loop.stdout = True
    checkpoints = list(loop)
    assert [c.step for c in checkpoints] == list(range(1, 9))
    assert relative_difference(checkpoints[-1].model_params, inline[-1].model_params) == 0.0
    assert checkpoints[-1].data_state == {"position": 8}
    said = capsys.readouterr().out
    assert "raised RuntimeError when read from a background thread" in said
    assert "prefetch=0" in said


def test_by_default_a_slow_source_is_prefetched_and_a_fast_one_is_not():
    slow = Recorded(X_TRAIN, Y_TRAIN, 32, delay=0.002)
    list(digits_loop(data=slow, n_steps=20))
    # timed inline first (the set-up's read among them), then on the thread
    assert slow.threads[:PROBE_READS] == ["MainThread"] * PROBE_READS
    assert set(slow.threads[PROBE_READS:]) == {"flax_loop-prefetch"}
    fast = InMemory([(X_TRAIN[i : i + 32], Y_TRAIN[i : i + 32]) for i in range(0, 320, 32)])
    list(digits_loop(data=fast, n_steps=20))
    assert len(fast.threads) == 20 and set(fast.threads) == {"MainThread"}


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_a_bad_prefetch_is_refused(value):
    with pytest.raises(ConfigError, match=f"prefetch must be .*{value!r}"):
        digits_loop(prefetch=value)


def test_prefetched_batches_are_the_batches_read_in_order():
    # Several steps per dispatch stack what the thread read, in order.
    source = Recorded(X_TRAIN, Y_TRAIN, 32)
    grouped = list(
        digits_loop(
            data=source, n_steps=12, n_steps_per_checkpoint=6, steps_per_dispatch=4, prefetch=5
        )
    )
    single = list(
        digits_loop(
            data=ResumableBatches(X_TRAIN, Y_TRAIN, 32),
            n_steps=12,
            n_steps_per_checkpoint=6,
            prefetch=0,
        )
    )
    assert [c.data_state for c in grouped] == [{"position": 6}, {"position": 12}]
    for a, b in zip(grouped, single):
        assert relative_difference(a.model_params, b.model_params) < 1e-6
        np.testing.assert_allclose(a.losses, b.losses, rtol=1e-6)
