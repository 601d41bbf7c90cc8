"""The progress report: plain lines in logs, a rich bar in terminals."""

import io

import jax
import optax
from rich.console import Console

from flax_loop import TrainLoop, TrainTask, set_console
from flax_loop.run.progress import ProgressReport
from tests.helpers import MLP, batches, cross_entropy, digits_loop, digits_split

X_TRAIN, Y_TRAIN, _, _ = digits_split()


def run_with_console(fake_console, **options):
    set_console(fake_console)
    try:
        model = MLP()
        loop = TrainLoop(
            init=model.init,
            task=TrainTask(
                model.apply, optax.adam(1e-2), cross_entropy, batches(X_TRAIN, Y_TRAIN, 32)
            ),
            rnkey=jax.random.key(0),
            stdout=False,
            progress=True,
            **options,
        )
        checkpoints = list(loop)
    finally:
        set_console(None)
    return checkpoints


def test_plain_lines_when_not_a_terminal():
    buffer = io.StringIO()
    checkpoints = run_with_console(
        Console(file=buffer, width=120, force_terminal=False, force_jupyter=False),
        n_steps=30,
        n_steps_per_checkpoint=10,
    )
    lines = [line for line in buffer.getvalue().splitlines() if line]
    assert [line.split(" · ")[0] for line in lines] == ["step 10/30", "step 20/30", "step 30/30"]
    last = lines[-1]
    # the interval's mean loss, and the elapsed time
    assert "steps/s" in last and f"loss {checkpoints[-1].mean_loss:.4g}" in last
    assert " elapsed" in last
    assert "ETA 0:00:00" in last


def test_bar_in_a_terminal():
    buffer = io.StringIO()
    run_with_console(
        Console(file=buffer, width=120, force_terminal=True, color_system=None),
        n_steps=20,
        n_steps_per_checkpoint=10,
    )
    out = buffer.getvalue()
    assert "20/20" in out and "steps/s" in out and "elapsed 0:00:0" in out
    assert "loss " in out  # the loss of the newest finished step


def test_report_throttles_updates(monkeypatch):
    clock = iter([0.0, 0.01, 0.02, 0.5, 0.6])
    monkeypatch.setattr("flax_loop.run.progress.time.perf_counter", lambda: next(clock))
    buffer = io.StringIO()
    report = ProgressReport(Console(file=buffer, force_terminal=False))
    shown = []
    monkeypatch.setattr(report, "_show", lambda step, now, line=False: shown.append(step))
    report.start(step=0, total=100)  # t=0.0; next refresh after 30 s of plain lines
    for step in (1, 2, 3):
        report.advance(step)
    assert shown == []
    report.checkpoint(4, loss=0.5)
    assert shown == [4]


def test_progress_does_not_change_results():
    def final(progress):
        set_console(Console(file=io.StringIO()))
        try:
            loop = digits_loop(optimizer=optax.sgd(0.1), n_steps=5, progress=progress)
            return list(loop)[-1].loss
        finally:
            set_console(None)

    assert final(True) == final(False)
