"""Crash safety: SIGKILL at random moments never loses or damages finished work.

A real training process writes a checkpoint every 5 steps; it is killed with
SIGKILL at seeded random moments and restarted from its directory each time.
At the end its parameters equal, bit for bit, those of a run never
interrupted. FLAX_LOOP_SLOW=1 raises the number of kills from 2 to 100.
"""

import os
import random
import signal
import time

import numpy as np
import pytest

from flax_loop.checkpoint import parse
from flax_loop.checkpoint.format import TEMPORARY_PREFIX
from tests.helpers import (
    SLOW,
    assert_same_arrays,
    directory_bytes,
    file_names,
    resume_worker,
    run,
    start,
)

N_KILLS = 100 if SLOW else 2
# A kill lands on average 0.3 s (15 steps) after the run's first checkpoint
# (a fixed delay after start-up left two kills in one interval on a slow
# machine): enough steps that the run is still going after every kill.
N_STEPS, EVERY, KEEP, STEP_SECONDS = 30 * N_KILLS, 5, 2, 0.02


def command(directory, out=None, delay=STEP_SECONDS):
    options = ["--every", EVERY, "--keep", KEEP, "--devices", 1, "--batch-delay", delay]
    return resume_worker(directory, N_STEPS, *options, *(["--out", out] if out else []))


def check_directory(directory):
    names = file_names(directory) if os.path.isdir(directory) else []
    assert len(names) <= KEEP + 1, names
    for name in names:
        if not name.startswith(TEMPORARY_PREFIX):
            parse.read(os.path.join(directory, name))  # raises if damaged
    return sum(name.startswith(TEMPORARY_PREFIX) for name in names)


def test_sigkill_at_random_moments_then_exact_resume(tmp_path):
    rng = random.Random(20261122)
    directory = tmp_path / "killed"
    outputs, kills, torn_writes, resumed_from = [], 0, 0, []
    deadline = time.monotonic() + 30 * N_KILLS
    while kills < N_KILLS:
        assert time.monotonic() < deadline, f"only {kills} kills in time"
        process = start(command(directory))
        try:
            lines = []
            for line in process.stdout:
                lines.append(line)
                if line.startswith("START"):
                    resumed_from.append(int(line.split()[1]))
                if line.startswith("WROTE"):
                    break  # each run gets past a checkpoint of its own, however slow
            time.sleep(rng.uniform(0.0, 0.6))
            process.send_signal(signal.SIGKILL)
            rest, _ = process.communicate(timeout=60)
        finally:
            process.kill()
        output = "".join(lines) + rest
        outputs.append(output)
        assert "Traceback" not in output, output
        if process.returncode == 0:
            break  # finished before the kill landed
        assert process.returncode == -signal.SIGKILL
        kills += 1
        torn_writes += check_directory(directory)
    outputs.append(run(command(directory, tmp_path / "resumed.npz", delay=0)))
    assert not any("damaged" in output for output in outputs)
    run(command(tmp_path / "straight", tmp_path / "straight.npz", delay=0))
    assert int(np.load(tmp_path / "resumed.npz")["step"]) == N_STEPS
    assert_same_arrays(tmp_path / "resumed.npz", tmp_path / "straight.npz")
    assert kills == N_KILLS
    # The kills landed in the middle of training, not only at start-up: each
    # run (of the first 4) started from a step of its own.
    assert len(set(resumed_from)) >= min(N_KILLS, 4), resumed_from
    print(f"{kills} kills, resumed from {sorted(set(resumed_from))}, {torn_writes} torn writes")


@pytest.fixture
def checkpoint():
    from tests.helpers import train

    return train(10, 5)


@pytest.mark.parametrize(
    "target, error",
    [
        ("os.replace", RuntimeError("interrupted between write and rename")),
        ("os.fsync", OSError(28, "No space left on device")),
        ("flax_loop.checkpoint.format.write", OSError(28, "No space left on device")),
    ],
    ids=["exception-before-rename", "fsync-disk-full", "write-disk-full"],
)
def test_writer_failure_keeps_the_previous_file_and_reaches_the_user(
    tmp_path, monkeypatch, checkpoint, target, error
):
    from flax_loop import CheckpointFileReader, CheckpointFileWriter
    from flax_loop.errors import CheckpointError

    first, second = checkpoint
    writer = CheckpointFileWriter(output_dir=str(tmp_path))
    writer(first)
    before = directory_bytes(tmp_path)

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(target, fail)
    expected = CheckpointError if isinstance(error, OSError) else type(error)
    with pytest.raises(expected) as raised:
        writer(second)
    if isinstance(error, OSError):
        assert "No space left on device" in str(raised.value)
        assert "intact" in str(raised.value)
    monkeypatch.undo()
    assert directory_bytes(tmp_path) == before  # no temporary file left either
    restored = CheckpointFileReader(dir=str(tmp_path), target=None).read_newest()
    assert restored.step == 5
