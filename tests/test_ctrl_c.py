"""What a user sees on Ctrl-C: in the bar's line, a closing line, no tracebacks."""

import io
import os
import signal
import subprocess
import sys
import textwrap

import jax
import optax
import pytest
from rich.console import Console

from flax_loop import TrainLoop, TrainTask
from flax_loop.log import set_console
from flax_loop.run.preemption import PreemptionGuard
from flax_loop.run.progress import ProgressReport
from tests.helpers import MLP, ROOT, batches, cross_entropy, digits_split

X_TRAIN, Y_TRAIN, _, _ = digits_split()


def test_a_stop_request_shows_in_the_bar_and_blanks_its_eta(capfd):
    guard = PreemptionGuard([signal.SIGINT])
    terminal = Console(file=io.StringIO(), force_terminal=True, width=160)
    report = ProgressReport(terminal, guard.notice)
    guard.quiet = report.live
    report.start(step=0, total=1000)
    report.advance(10)
    with guard:
        signal.raise_signal(signal.SIGINT)
        shown = report.rendered()  # the columns as the bar renders them
        notice, eta = shown["notice"], shown["remaining"]
    report.stop()
    assert notice == "stopping after this step (press Ctrl-C again to stop at once)"
    assert eta == ""
    assert "stopping" not in capfd.readouterr().err  # nothing written into the bar's line


def test_without_a_bar_the_request_is_one_line_on_stderr(capfd):
    guard = PreemptionGuard([signal.SIGTERM])
    with guard:
        signal.raise_signal(signal.SIGTERM)
    assert capfd.readouterr().err == "flax_loop: stopping after this step (SIGTERM received).\n"


def test_a_stopped_run_ends_with_a_line_that_says_where_and_how_to_resume():
    out = io.StringIO()
    set_console(Console(file=out, width=200))
    loop = TrainLoop(
        init=MLP(features=(16,)).init,
        task=TrainTask(MLP(features=(16,)).apply, optax.sgd(0.1), cross_entropy,
                       batches(X_TRAIN, Y_TRAIN, 32)),
        rnkey=jax.random.key(0), n_steps=20, n_steps_per_checkpoint=5,
        preemption_signals=[signal.SIGUSR1],
    )  # fmt: skip
    steps = []
    for checkpoint in loop:
        steps.append(checkpoint.step)
        if checkpoint.step == 10:
            signal.raise_signal(signal.SIGUSR1)
    assert steps == [5, 10, 10] and checkpoint.preempted
    text = " ".join(out.getvalue().split())
    assert "Stopped: at step 10 (SIGUSR1), after its checkpoint. Run again to resume" in text
    assert "Done:" not in text


PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    import jax, optax
    from flax_loop import TrainLoop, TrainTask
    from tests.helpers import MLP, batches, cross_entropy, digits_split

    # Python's own Ctrl-C handling, as in a terminal (a shell's background
    # job, such as a suite started with `&`, starts with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    X_TRAIN, Y_TRAIN, _, _ = digits_split()

    model = MLP(features=(16,))

    def init(*args, **kwargs):
        if sys.argv[1] == "set-up":
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while set-up runs
        return model.init(*args, **kwargs)

    loop = TrainLoop(
        init=init, task=TrainTask(model.apply, optax.sgd(0.1), cross_entropy,
                                  batches(X_TRAIN, Y_TRAIN, 32)),
        rnkey=jax.random.key(0), n_steps=100000, n_steps_per_checkpoint=50, stdout=False,
    )
    for checkpoint in loop:
        if checkpoint.step == 100:  # Ctrl-C twice while the loop's body runs
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10)
    """
)


@pytest.mark.parametrize(
    "when, said",
    [
        ("training", "flax_loop: stopped at once by a second Ctrl-C"),
        ("set-up", "flax_loop: interrupted during set-up"),
    ],
)
def test_an_uncaught_ctrl_c_is_two_lines_not_a_traceback(when, said):
    env = {**os.environ, "PYTHONPATH": ROOT}
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, when],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == -signal.SIGINT, result.stderr[-3000:]
    assert said in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.rstrip().endswith("KeyboardInterrupt")
