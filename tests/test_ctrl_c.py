"""What a user sees on Ctrl-C: in the bar's line, a closing line, no tracebacks."""

import io
import os
import re
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


def stopped_by_sigusr1():
    """A loop of 20 steps, a checkpoint every 5, stopped by SIGUSR1."""
    return TrainLoop(
        init=MLP(features=(16,)).init,
        task=TrainTask(MLP(features=(16,)).apply, optax.sgd(0.1), cross_entropy,
                       batches(X_TRAIN, Y_TRAIN, 32)),
        rnkey=jax.random.key(0), n_steps=20, n_steps_per_checkpoint=5,
        preemption_signals=[signal.SIGUSR1],
    )  # fmt: skip


def test_a_stopped_run_ends_with_a_line_that_says_where_and_how_to_resume():
    out = io.StringIO()
    set_console(Console(file=out, width=200))
    loop = stopped_by_sigusr1()
    steps = []
    for checkpoint in loop:
        steps.append(checkpoint.step)
        if steps == [5, 10]:  # once: a second signal would insist (its own handling)
            signal.raise_signal(signal.SIGUSR1)
    assert steps == [5, 10]  # the body's checkpoint was the last, seen once
    text = " ".join(out.getvalue().split())
    # no file was written: nothing to resume from, and the line says so
    assert "Stopped: at step 10 (SIGUSR1), after its checkpoint. No checkpoint was written" in text
    assert "Done:" not in text


def test_a_stopped_run_names_the_file_a_run_again_resumes_from(tmp_path):
    from flax_loop import CheckpointFileWriter, clear_stop

    out = io.StringIO()
    set_console(Console(file=out, width=300))
    loop = stopped_by_sigusr1()
    with CheckpointFileWriter(output_dir=str(tmp_path), stdout=False) as write:
        for checkpoint in loop:
            write(checkpoint)
            if checkpoint.step == 5:
                signal.raise_signal(signal.SIGUSR1)
    set_console(None)
    clear_stop()
    text = " ".join(out.getvalue().split())
    assert f"resume from the last checkpoint written ({tmp_path}/regular.5.ckpt)" in text


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


# -- in a terminal: a pseudo-terminal, Ctrl-C typed as a user types it ---------

TERMINAL_PROGRAM = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    import jax, optax
    from flax_loop import TrainLoop, TrainTask
    from tests.helpers import MLP, batches, cross_entropy, digits_split
    x, y, _, _ = digits_split()
    model = MLP(features=(16,))
    loop = TrainLoop(init=model.init, rnkey=jax.random.key(0), n_steps=10**7,
                     n_steps_per_checkpoint={every},
                     task=TrainTask(model.apply, optax.sgd(0.1), cross_entropy,
                                    batches(x, y, 32)))
    print("READY", flush=True)
    for checkpoint in loop:
        print("BODY", flush=True)
        time.sleep({sleep})
    print("ENDED", flush=True)
    """
)


def in_a_terminal(every, sleep, presses, columns=None):
    """Runs the program in a pseudo-terminal (the bar's default there), its
    body sleeping `sleep` seconds; types Ctrl-C a second after each text of
    `presses` is printed; returns its output and exit status."""
    import pty
    import select
    import time

    pid, terminal = pty.fork()
    if pid == 0:  # the child: the pseudo-terminal is its console
        program = TERMINAL_PROGRAM.format(root=ROOT, every=every, sleep=sleep)
        from tests.flags import xla_flags

        environment = {**os.environ, "XLA_FLAGS": xla_flags(1)}  # one device, as a reader's
        if columns is not None:  # the terminal's size, set before the program starts
            import fcntl
            import struct
            import termios

            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
            environment.pop("COLUMNS", None)
        os.execve(sys.executable, [sys.executable, "-c", program], environment)
    output = b""

    def read_until(text, seconds):
        nonlocal output
        deadline = time.monotonic() + seconds
        while text not in output and time.monotonic() < deadline:
            if select.select([terminal], [], [], 0.05)[0]:
                try:
                    output += os.read(terminal, 65536)
                except OSError:  # the program ended
                    return

    try:
        for text in presses:
            read_until(text, 120)
            assert text in output, output.decode(errors="replace")
            read_until(b"\xff", 1.0)  # the steps run (and the bar draws them)
            os.write(terminal, b"\x03")
        read_until(b"\xff", 60)  # to the end
        _, status = os.waitpid(pid, 0)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(terminal)
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode(errors="replace"))
    return plain, status


def test_in_a_terminal_one_ctrl_c_stops_after_the_bar_s_last_line():
    out, status = in_a_terminal(every=10**6, sleep=0, presses=[b"READY"])
    assert os.waitstatus_to_exitcode(status) == 0, out[-3000:]
    assert "ENDED" in out and "KeyboardInterrupt" not in out
    before, _, after = out.partition("Stopped:")
    # the bar, by default in a terminal: its steps, the live loss, its labels
    bar = [line for line in before.splitlines() if "steps/s" in line]
    assert bar and "loss " in bar[-1] and "/10,000,000" in bar[-1], before[-3000:]
    assert "stopping (Ctrl-C: stop now)" in before
    # set-up said what it was doing as it did it, on a line the bar replaced
    assert "flax_loop: compiling the step" in before.split("Model:")[0], before[:3000]
    assert "steps/s" not in after  # nothing of the bar after the closing line


def test_in_a_terminal_a_second_ctrl_c_in_the_loop_body_raises_keyboard_interrupt():
    # the first press while the steps run: the last checkpoint comes; the
    # second while its body runs
    out, status = in_a_terminal(every=10**6, sleep=60, presses=[b"READY", b"BODY"])
    assert os.waitstatus_to_exitcode(status) == -signal.SIGINT, out[-3000:]
    assert "KeyboardInterrupt" in out and "ENDED" not in out
    assert out.count("stopping after this step") <= 1  # the first press said once
    assert "Traceback" not in out


def test_a_ctrl_c_at_an_interactive_prompt_ends_only_its_call(monkeypatch):
    """In a script a stop by Ctrl-C ends the process's training, as SIGTERM
    does; at a prompt or in a notebook the next cell trains on."""
    from flax_loop import clear_stop
    from flax_loop.run.preemption import note_process_stop, process_stop

    note_process_stop(signal.SIGINT, "Ctrl-C at step 5")
    assert process_stop() == "Ctrl-C at step 5"
    clear_stop()
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    note_process_stop(signal.SIGINT, "Ctrl-C at step 5")
    assert process_stop() is None
    note_process_stop(signal.SIGTERM, "SIGTERM at step 5")  # a scheduler's, anywhere
    assert process_stop() == "SIGTERM at step 5"


@pytest.mark.parametrize("columns", [40, 80])
def test_in_a_narrow_terminal_the_bar_keeps_its_most_important_fields_on_one_line(columns):
    """At 40 columns the steps and the loss (the interval's running mean)
    show, nothing cut mid-word; no line is wider than the terminal, so
    no redraw leaves a stale copy behind, with the stop's notice too."""
    out, status = in_a_terminal(every=10**6, sleep=0, presses=[b"READY"], columns=columns)
    assert os.waitstatus_to_exitcode(status) == 0, out[-3000:]
    lines = [line for line in out.replace("\r", "\n").splitlines() if line.strip()]
    # the bar's lines (the log's lines are printed once, and may wrap)
    bar = [line for line in lines if "/10,000,000" in line or "stopping (" in line]
    assert max(len(line) for line in bar) <= columns, [b for b in bar if len(b) > columns]
    assert any("loss " in line for line in bar), bar[-3:]
    assert not any("…" in line for line in bar)  # a field is shown whole or not at all
    assert any("stopping (" in line for line in bar)  # the notice found room
