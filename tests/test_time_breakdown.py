"""Where the time went: `Checkpoint.time_breakdown` and `loop.time_breakdown`.

Each part is checked against a cause the test controls (a loop body that
sleeps, a data stream that sleeps, a changed cadence that compiles) and the
run's total against the wall clock around it.
"""

import gc
import itertools
import time

import flax.linen as nn
import jax
import numpy as np
import pytest

from flax_loop.checkpoint import goodput
from flax_loop.run.throughput import PARTS, describe
from tests.helpers import batches, digits_loop, digits_split

X, Y, _, _ = digits_split()


def check_sums(breakdown):
    parts = sum(breakdown[part] for part in PARTS)
    assert parts == pytest.approx(breakdown["wall"], rel=0.02)
    assert all(breakdown[part] >= 0 for part in PARTS)


@pytest.fixture
def no_collection_pauses():
    """The objects of the tests run before this one kept out of the garbage
    collector's passes: after 70 tests in one process a full pass took
    0.39 s (577,000 objects), and such a pause lands in whichever part of
    the time breakdown is running (the caller's, late in a suite's worker:
    0.68 s in a first interval)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def test_the_callers_code_the_run_total_and_compiling_are_where_they_happened(
    without_compilation_cache,  # compiling is timed: a cached program takes none
    no_collection_pauses,
):
    jax.devices(), jax.random.key(0)  # the backend starts before the clock does
    started = time.perf_counter()
    loop = digits_loop(n_steps=60, n_steps_per_checkpoint=20, n_devices=1)
    checkpoints = []
    for checkpoint in loop:
        received = time.perf_counter()
        checkpoints.append(checkpoint)
        if checkpoint.step < 60:
            time.sleep(0.25)  # "evaluation"
    first, second, third = (c.time_breakdown for c in checkpoints)
    for breakdown in (first, second, third):
        check_sums(breakdown)
    # the caller's sleep is the next interval's caller time, less the moments
    # the devices still finished the interval beside it (device time: a few
    # ms of this MLP's steps); lower bounds and comparisons only: a loaded
    # machine stretches any upper bound
    assert 0.2 <= second["caller"] <= second["wall"], second
    assert 0.2 <= third["caller"] <= third["wall"], third
    assert first["caller"] < 0.2 <= second["caller"], first
    # compiling happens at set-up and while the first interval waits for its
    # closing step; later intervals compile nothing
    assert second["compile"] == 0 and third["compile"] == 0, (second, third)
    totals = loop.time_breakdown
    assert totals["compile"] > 0.2
    assert set(totals) == {"setup", *PARTS, "wall"}
    for part in ("data", "device", "caller"):
        assert totals[part] == pytest.approx(sum(b[part] for b in (first, second, third)))
    assert totals["compile"] > first["compile"]  # set-up compiled the first program
    # the run's total is the wall clock from construction to the last checkpoint
    # (less the test's own preparation of the data before TrainLoop starts)
    assert 2 * 0.25 < totals["wall"] <= received - started, totals
    assert sum(totals[p] for p in ("setup", *PARTS)) == pytest.approx(totals["wall"], rel=0.02)
    assert "your code" in describe(totals)
    assert goodput(third) == pytest.approx(third["device"] / third["wall"])
    assert checkpoints[-1].time_breakdown is not checkpoints[-2].time_breakdown


def slow(stream, seconds):
    for batch in stream:
        time.sleep(seconds)
        yield batch


def test_a_slow_stream_shows_as_data_time():
    data = slow(batches(X, Y, 32), 0.02)
    loop = digits_loop(data=data, n_steps=40, n_steps_per_checkpoint=20, n_devices=1, prefetch=0)
    *_, last = loop
    breakdown = last.time_breakdown
    check_sums(breakdown)
    assert breakdown["data"] >= 20 * 0.02
    parts = {part: breakdown[part] for part in PARTS}
    assert max(parts, key=parts.get) == "data", parts  # the stream's sleeps dominate


class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)


def test_a_heavy_step_is_device_time_and_a_changed_cadence_compiles(without_compilation_cache):
    data = itertools.cycle(list(itertools.islice(batches(np.tile(X, (1, 8)), Y, 256), 4)))
    loop = digits_loop(
        Wide(), data=data, n_steps=60, n_steps_per_checkpoint=20, n_devices=1, steps_per_dispatch=4
    )
    check_sums(loop.next_checkpoint().time_breakdown)
    second = loop.next_checkpoint()
    check_sums(second.time_breakdown)
    assert second.time_breakdown["compile"] == 0
    assert goodput(second.time_breakdown) > 0.85  # a step of ~10 ms: the devices' time
    loop.n_steps_per_checkpoint = 10  # its closing group of two steps compiles now
    third = loop.next_checkpoint()
    assert third.step == 50
    check_sums(third.time_breakdown)
    assert third.time_breakdown["compile"] > 0.05


def test_a_run_trained_to_its_end_says_where_its_time_went(capsys):
    loop = digits_loop(n_steps=20, n_steps_per_checkpoint=10, n_devices=1, stdout=True)
    *_, last = loop
    out = capsys.readouterr().out
    wall = loop.time_breakdown["wall"]
    assert f"Done: 20 steps in {wall:.1f} s: " in out
    assert describe(loop.time_breakdown) in out
    loop.n_steps = 30  # one more call: stopped at step 20 of a shorter target
    for _ in loop.run(25):
        pass
    assert "Done:" not in capsys.readouterr().out


def test_a_finished_run_run_again_compiles_no_step_and_says_so(tmp_path, capsys):
    from flax_loop import CheckpointFileReader, CheckpointFileWriter

    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        for checkpoint in digits_loop(n_steps=20, n_steps_per_checkpoint=10, n_devices=1):
            write(checkpoint)
    capsys.readouterr()
    from tests.helpers import MLP

    reader = CheckpointFileReader(dir=str(tmp_path), target=MLP().init)
    again = digits_loop(n_steps=20, n_devices=1, init=reader, stdout=True)
    assert set(again.compiled.status().values()) == {"on first call"}  # nothing compiled
    assert list(again) == []
    out = capsys.readouterr().out
    assert "Nothing to train: the loop is at step 20 and trains to step 20" in out
    assert "Done:" not in out
    again.n_steps = 25  # more to train after all: the steps compile when first called
    *_, last = list(again)
    assert last.step == 25 and "Done: 5 steps (to step 25) in " in capsys.readouterr().out
