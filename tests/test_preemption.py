"""Preemption: SIGTERM or SIGINT yields a last checkpoint, then iteration stops."""

import signal
import time

import jax
import optax
import pytest

from flax_loop import TrainLoop, TrainTask, clear_stop
from flax_loop.errors import StoppedError
from tests.helpers import (
    MLP,
    assert_same_arrays,
    batches,
    cross_entropy,
    digits_split,
    file_names,
    resume_worker,
    run,
    start,
)

X_TRAIN, Y_TRAIN, _, _ = digits_split()


def signalling_stream(at_batch, number):
    for index, batch in enumerate(batches(X_TRAIN, Y_TRAIN, 32)):
        if index == at_batch:
            signal.raise_signal(number)
        yield batch


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_yields_a_preempted_checkpoint_and_restores_handlers(number):
    seen = []
    previous = signal.signal(number, lambda *args: seen.append(args[0]))
    try:
        model = MLP()
        loop = TrainLoop(
            init=model.init,
            task=TrainTask(
                model.apply, optax.sgd(0.1), cross_entropy, signalling_stream(13, number)
            ),
            rnkey=jax.random.key(0),
            n_steps=100,
            n_steps_per_checkpoint=5,
            stdout=False,
            # read inline: the default reads on a thread, ahead of the steps,
            # when the first reads look slow (a loaded machine), and the
            # signal would then arrive a step or two early
            prefetch=0,
        )
        checkpoints = list(loop)
        # The signal arrives while batch 13 (0-based) is fetched for step 14:
        # that step, already under way, still runs; no later one does.
        assert [c.step for c in checkpoints] == [5, 10, 14]
        assert [c.preempted for c in checkpoints] == [False, False, True]
        assert checkpoints[-1].n_completed_steps == 4
        assert seen == []  # the handler of the loop took it, not ours
        # Handlers are restored: the signal now reaches the original one.
        signal.raise_signal(number)
        assert seen == [number]
        # The stop ends the process's training until it is cleared.
        with pytest.raises(StoppedError, match="clear_stop"):
            loop.next_checkpoint()
        clear_stop()
        assert loop.next_checkpoint().step == 15
    finally:
        signal.signal(number, previous)


def test_preemption_can_be_disabled():
    handler = signal.getsignal(signal.SIGTERM)
    model = MLP()
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches(X_TRAIN, Y_TRAIN, 32)),
        rnkey=jax.random.key(0),
        n_steps=3,
        stdout=False,
        preemption_signals=(),
    )
    handlers = [signal.getsignal(signal.SIGTERM) for _ in loop]
    assert handlers == [handler] * 3  # never replaced while the loop ran


def worker(directory, n_steps, *args):
    return resume_worker(directory, n_steps, "--devices", 2, "--every", 20, *args)


def test_sigterm_to_a_real_process_then_exact_resume(tmp_path):
    directory = tmp_path / "run"
    process = start(worker(directory, 400, "--batch-delay", 0.01))
    try:
        lines = []
        for line in process.stdout:
            lines.append(line.strip())
            if line.startswith("WROTE 20"):
                time.sleep(0.137)  # mid-interval, a few steps past 20
                process.send_signal(signal.SIGTERM)
                break
        rest, _ = process.communicate(timeout=120)
        lines += rest.split("\n")
    finally:
        process.kill()
    assert process.returncode == 0, "\n".join(lines)
    preempted = [line for line in lines if line.endswith("preempted")]
    assert len(preempted) == 1, lines
    step = int(preempted[0].split()[1])
    assert 20 < step < 100
    assert f"DONE {step}" in lines
    assert f"regular.{step}.ckpt" in file_names(directory)

    resumed = run(worker(directory, 100, "--out", tmp_path / "resumed.npz"))
    assert f"START {step}" in resumed
    run(worker(tmp_path / "straight", 100, "--out", tmp_path / "straight.npz"))
    assert_same_arrays(tmp_path / "resumed.npz", tmp_path / "straight.npz")
