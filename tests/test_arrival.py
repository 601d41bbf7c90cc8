"""The body runs while the devices finish the interval; its numbers arrive on their own.

A `for` loop (one process; a live bar or none) hands each checkpoint out as soon as its
arrays are dispatched. Its statistics are filled in the first time one is
read, from a transfer that waited for the devices on a thread of its own;
a non-finite interval raises when they are read, when a writer is given it
and before the next interval, never later.
"""

import io
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from rich.console import Console

from flax_loop import CheckpointFileWriter, TrainLoop, TrainTask, set_console
from flax_loop.checkpoint import as_summary, train_statistics
from flax_loop.errors import NonFiniteError
from flax_loop.run.throughput import TimeBreakdown
from tests.helpers import MLP, ROOT, batches, cross_entropy, digits_loop, digits_split, file_names
from tests.test_nonfinite import poisoned_loop

STATISTICS = ("loss", "mean_loss", "n_nonfinite_steps", "elapsed_time")


def slow_loss(logits, labels):
    """The digits loss after 60 products of 256x256 matrices the loss ignores."""

    def product(_, matrix):
        return jnp.tanh(matrix @ matrix)

    busy = jax.lax.fori_loop(0, 60, product, jnp.full((256, 256), 0.01))
    return cross_entropy(logits, labels) + 0.0 * busy.sum()


def slow_loop(n_steps, **options):
    x, y, _, _ = digits_split()
    model = MLP()
    return TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.sgd(0.1), slow_loss, batches(x, y, 32)),
        rnkey=jax.random.key(0),
        n_steps=n_steps,
        n_steps_per_checkpoint=4,
        devices=jax.devices()[:1],
        stdout=False,
        **options,
    )


def handed_out_done(loop):
    """Per checkpoint: whether its interval's last step was done (its gradients
    ready) when the body got it."""
    done = []
    for checkpoint in loop:
        done.append(all(leaf.is_ready() for leaf in jax.tree.leaves(checkpoint.grads)))
        assert np.isfinite(checkpoint.loss)  # waits for the steps
    return done


def test_the_body_gets_the_checkpoint_while_the_devices_still_run_its_steps():
    # (the first interval may be done when handed out: its copy compiles meanwhile)
    assert False in handed_out_done(slow_loop(12))
    # progress printed as lines shows each checkpoint's loss in its place:
    # read before the body runs
    assert all(handed_out_done(slow_loop(8, progress=True)))


def test_a_progress_bar_shows_the_numbers_when_they_arrive():
    screen = io.StringIO()
    set_console(Console(file=screen, force_terminal=True, width=120))  # a bar, live
    assert False in handed_out_done(slow_loop(12, progress=True))
    assert "loss" in screen.getvalue()


def test_numbers_that_arrive_later_are_those_read_at_once():
    later = list(digits_loop(n_steps=12, n_steps_per_checkpoint=4))
    at_once = list(digits_loop(n_steps=12, n_steps_per_checkpoint=4, progress=True))
    for a, b in zip(later, at_once, strict=True):
        assert [getattr(a, name) for name in STATISTICS[:3]] == [
            getattr(b, name) for name in STATISTICS[:3]
        ]
        assert a.train_metrics == b.train_metrics
        np.testing.assert_array_equal(a.losses, b.losses)
        assert a.elapsed_time > 0 and set(a.throughput) == set(b.throughput)
    assert train_statistics(later[-1])["loss"] == train_statistics(at_once[-1])["loss"]


def test_a_non_finite_interval_handed_out_early_is_never_read_as_sound_nor_written(tmp_path):
    loop = poisoned_loop("raise", n_devices=1)  # poisoned at step 6 of 20, every 5
    writer = CheckpointFileWriter(output_dir=str(tmp_path))
    seen = []
    with pytest.raises(NonFiniteError, match="detected at step 10"):
        for checkpoint in loop:
            seen.append(checkpoint.step)
            if checkpoint.step == 10:
                for name in STATISTICS:  # each read raises, again and again
                    with pytest.raises(NonFiniteError, match="detected at step 10"):
                        getattr(checkpoint, name)
                with pytest.raises(NonFiniteError):  # an evaluation's summary of it too
                    as_summary(checkpoint)
            writer(checkpoint)
    assert seen == [5, 10]
    assert file_names(tmp_path) == ["regular.5.ckpt"]
    assert loop.step == 10  # nothing trained past the bad interval


def test_a_non_finite_interval_raises_before_the_next_one_even_unread():
    loop = poisoned_loop("raise", n_devices=1)
    seen = []
    with pytest.raises(NonFiniteError, match="detected at step 10"):
        for checkpoint in loop:
            seen.append(checkpoint.step)
    assert seen == [5, 10] and loop.step == 10


def test_the_devices_busy_beside_the_body_count_as_device_time_not_the_callers():
    times = TimeBreakdown(handed_out=10.0)
    # the devices finished the previous interval at 11.5, the body asked again at 12
    parts = times.close(
        started=12.0, ended=15.0, data=0.5, device=2.5, compiled=0.0, busy_until=11.5
    )
    assert parts == {"compile": 0.0, "data": 0.5, "device": 4.0, "caller": 0.5, "wall": 5.0}
    # done before the checkpoint was handed out: the body's time is all the caller's
    parts = times.close(
        started=16.0, ended=17.0, data=0.0, device=1.0, compiled=0.0, busy_until=14.0
    )
    assert parts["caller"] == 1.0 and parts["device"] == 1.0
    # a body that does nothing: after the first interval (set-up's last words
    # count as the caller's there), the loop's time is the devices'
    breakdowns = [checkpoint.time_breakdown for checkpoint in slow_loop(12)]
    for parts in breakdowns[1:]:
        assert parts["caller"] < 0.1 * parts["device"], parts


@pytest.mark.parametrize("path", ["for", "next_checkpoint"])
def test_after_a_non_finite_interval_a_mended_state_trains_on(path):
    loop = poisoned_loop("raise", n_devices=1)  # poisoned at step 6 of 20, every 5
    seen = []
    with pytest.raises(NonFiniteError, match="detected at step 10"):
        if path == "for":
            for checkpoint in loop:
                seen.append(checkpoint)
        else:
            seen.append(loop.next_checkpoint())
            loop.next_checkpoint()
    good = seen[0]
    assert good.step == 5
    loop.update_state(lambda saved: saved.with_arrays(good.arrays()))
    rest = list(loop)  # the error was raised once: the mended state trains on
    assert [checkpoint.step for checkpoint in rest] == [15, 20]
    assert all(np.isfinite(checkpoint.loss) for checkpoint in rest)


def test_the_interpreter_waits_at_exit_for_numbers_on_their_way():
    # A checkpoint handed out early and held to interpreter exit: the thread
    # that reads its numbers is waited for (before `atexit` handlers run), not
    # killed inside JAX while the interpreter shuts down, which aborted the
    # process ("terminate called ... exception not rethrown") in 1 exit of 3.
    program = """
import atexit, jax, jax.numpy as jnp
from flax_loop.run.arrival import Arrival
busy = jax.jit(lambda m: jax.lax.fori_loop(0, 300, lambda _, m: jnp.tanh(m @ m), m))
arrival = Arrival({"loss": busy(jnp.full((256, 256), 0.01)).sum()}, later=True)
atexit.register(lambda: print("on their way at exit:", arrival.pending))
"""
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["on", "their", "way", "at", "exit:", "False"]
