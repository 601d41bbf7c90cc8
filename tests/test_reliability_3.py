"""What an attacker found in 0.2.0's new surfaces (Orbax, locks, prefetch, the
CLI, writers, profiling), each scenario reduced and held (reliability, round 3)."""

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from rich.console import Console

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
    Summary,
    SummaryLogger,
    clear_stop,
)
from flax_loop.checkpoint import format, list_checkpoints, lock, parse
from flax_loop.errors import CheckpointCorruptError, CheckpointError
from flax_loop.log import set_console
from flax_loop.output import cli
from tests.helpers import ROOT, digits_loop, digits_split, file_names, hand_trained

X_TRAIN, Y_TRAIN, _, _ = digits_split()


def one_checkpoint():
    """The checkpoint at step 1 of a digits MLP (a hand-written step; no loop)."""
    return hand_trained(1, 1)[0]


def run_program(source, timeout=180):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_output(*args):
    out = io.StringIO()
    code = cli.main(list(args), console=Console(file=out, width=1000))
    return code, out.getvalue()


# -- 1. Orbax writes pending at exit finish; a failure then exits 75 -----------


ORBAX_PROGRAM = """
    import sys, jax
    from tests.helpers import digits_loop
    from flax_loop import OrbaxCheckpointWriter

    loop = digits_loop(n_steps=20, n_steps_per_checkpoint=10, n_devices=1)
    writer = OrbaxCheckpointWriter(output_dir={directory!r}, keep=3)
    for checkpoint in loop:
        writer(checkpoint)
    {ending}
    print("BODY DONE")
    {raising}
"""


@pytest.mark.parametrize("raising", [False, True], ids=["ends", "raises"])
def test_an_orbax_write_pending_at_exit_is_finished(tmp_path, raising):
    pytest.importorskip("orbax.checkpoint")
    result = run_program(
        ORBAX_PROGRAM.format(
            directory=str(tmp_path),
            ending="",
            raising='raise RuntimeError("the caller failed")' if raising else "",
        )
    )
    assert "BODY DONE" in result.stdout, result.stderr
    assert result.returncode == (1 if raising else 0), result.stderr[-3000:]
    assert "cannot schedule new futures" not in result.stderr
    assert sorted(name for name in os.listdir(tmp_path) if not name.startswith(".")) == [
        "10",
        "20",
    ]
    from flax_loop import OrbaxCheckpointReader

    assert OrbaxCheckpointReader(dir=str(tmp_path), target=None).steps() == [10, 20]


def test_an_orbax_write_failing_at_exit_exits_75(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    failing = """
    import errno
    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device")
    writer.manager.wait_until_finished = full_disk
    """
    result = run_program(
        ORBAX_PROGRAM.format(
            directory=str(tmp_path),
            ending=textwrap.indent(textwrap.dedent(failing), "    "),
            raising="",
        )
    )
    assert "BODY DONE" in result.stdout, result.stderr
    assert result.returncode == 75, result.stdout + result.stderr[-3000:]
    assert "No space left on device" in result.stdout


# -- 2. a lock file planted as a link is refused; its target is untouched ------


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_linked_lock_file_is_refused_and_its_target_kept(tmp_path, link):
    outside = tmp_path / "precious.txt"
    outside.write_text("precious")
    directory = tmp_path / "ckpts"
    directory.mkdir()
    planted = directory / ".lock.regular.lock"
    (os.symlink if link == "symbolic" else os.link)(outside, planted)
    with pytest.raises(CheckpointError, match=r"lock.*(symbolic link|hard links).*Remove it"):
        CheckpointFileWriter(output_dir=str(directory))(one_checkpoint())
    assert outside.read_text() == "precious"
    assert file_names(directory) == []


# -- 3. the reading thread never reads past the last step, nor is waited for --


class CountedStream:
    """Batches whose reads take `seconds` each; read number `block_at` blocks
    until `release` is set (a queue waiting for data that never comes). Its
    state is the number of reads, so a checkpoint's data state tells how
    many batches were trained."""

    def __init__(self, block_at, seconds=0.002):
        self.block_at, self.seconds, self.reads = block_at, seconds, 0
        self.release = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        self.reads += 1
        if self.reads == self.block_at:
            self.release.wait(60)
        time.sleep(self.seconds)
        start = (self.reads * 32) % 1440
        return X_TRAIN[start : start + 32], Y_TRAIN[start : start + 32]

    def get_state(self):
        return {"reads": self.reads}

    def set_state(self, state):
        self.reads = state["reads"]


@pytest.mark.parametrize("prefetch", [None, 4])
def test_a_stream_of_exactly_n_steps_batches_ends_without_reading_past_it(prefetch):
    stream = CountedStream(block_at=21)
    try:
        loop = digits_loop(
            data=stream, n_steps=20, n_steps_per_checkpoint=10, n_devices=1, prefetch=prefetch
        )
        started = time.perf_counter()
        steps = [checkpoint.step for checkpoint in loop]
        took = time.perf_counter() - started
    finally:
        stream.release.set()
    assert steps == [10, 20]
    assert stream.reads == 20  # nothing read that the loop would not train
    assert took < 20  # the read past the end would block 60 s


def _wait_for_the_blocking_read(stream):
    deadline = time.monotonic() + 30
    while stream.reads < stream.block_at and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)


@pytest.mark.parametrize("how", ["sigterm", "break", "raise"])
def test_no_wait_for_a_read_in_progress_the_loop_will_not_use(how):
    # The thread (2 batches ahead) is inside the 12th read while the body
    # holds checkpoint 10, or while the loop waits for that batch.
    stream = CountedStream(block_at=12)
    loop = digits_loop(data=stream, n_steps=40, n_steps_per_checkpoint=10, n_devices=1, prefetch=2)
    try:
        if how == "sigterm":
            assert loop.next_checkpoint().step == 10
            _wait_for_the_blocking_read(stream)
            timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
            timer.start()
            started = time.perf_counter()
            checkpoint = loop.next_checkpoint()
            took = time.perf_counter() - started
            assert checkpoint.preempted and checkpoint.step == 11
            assert checkpoint.data_state == {"reads": 11}
        else:
            steps = []
            with pytest.raises(RuntimeError) if how == "raise" else contextlib.nullcontext():
                for checkpoint in loop:
                    steps.append(checkpoint.step)
                    _wait_for_the_blocking_read(stream)
                    started = time.perf_counter()
                    if how == "break":
                        break
                    raise RuntimeError("the body failed")
            took = time.perf_counter() - started
            assert steps == [10]
        assert took < 5, took  # the read blocks for 60 s
    finally:
        stream.release.set()
    # The read given up on is kept, not lost: training goes on from it (a
    # stop by SIGTERM ended the process's training until it is cleared).
    clear_stop()
    checkpoint = loop.next_checkpoint()
    assert checkpoint.step == 20 and checkpoint.data_state == {"reads": 20}


# -- 4. only regular files are read; anything else is reported and skipped -----


def _written(directory, steps=(2, 4), writer_type=CheckpointFileWriter):
    """`directory` holding the checkpoints of `steps` (a run checkpointing every 2)."""
    loop = digits_loop(n_steps=max(steps), n_steps_per_checkpoint=2, n_devices=1)
    with writer_type(output_dir=str(directory), keep=5) as writer:
        for checkpoint in loop:
            if checkpoint.step in steps:
                writer(checkpoint)


def test_a_fifo_or_a_dangling_link_named_like_a_checkpoint_is_reported_and_skipped(tmp_path):
    _written(tmp_path)
    os.mkfifo(tmp_path / "regular.6.ckpt")
    os.symlink(tmp_path / "gone.ckpt", tmp_path / "regular.5.ckpt")
    started = time.perf_counter()
    code, out = cli_output("verify", str(tmp_path))
    assert code == cli.EXIT_DAMAGED
    assert "regular.6.ckpt is not a checkpoint: it is not a regular file" in out
    assert "regular.5.ckpt is not a checkpoint: a symbolic link to" in out
    assert "2 of 4 checkpoints" in out
    code, out = cli_output("ls", str(tmp_path))
    assert code == cli.EXIT_DAMAGED and "<- resumes" in out
    code, out = cli_output("show", str(tmp_path / "regular.6.ckpt"))
    assert code == cli.EXIT_USAGE and "not a regular file" in out
    assert CheckpointFileReader(dir=str(tmp_path), target=None).read_newest().step == 4
    assert time.perf_counter() - started < 30  # no read blocks on the FIFO


# -- 5. an Orbax directory is locked as a file directory is --------------------


def test_an_orbax_writer_is_refused_when_made_while_another_run_writes(tmp_path, monkeypatch):
    # Another run's writer holds the directory: a second run is refused when
    # it makes its writer,
    # before it trains; it once trained its first interval and the first run
    # then failed its writes ("it holds step 80").
    pytest.importorskip("orbax.checkpoint")
    from flax_loop import OrbaxCheckpointWriter

    monkeypatch.setattr(lock, "WAIT_SECONDS", 0.2)
    other_run = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from flax_loop import OrbaxCheckpointWriter
            writer = OrbaxCheckpointWriter(output_dir={str(tmp_path)!r})
            print("made", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert other_run.stdout.readline() == "made\n"
        with pytest.raises(CheckpointError, match=f"process id {other_run.pid}"):
            OrbaxCheckpointWriter(output_dir=str(tmp_path))
    finally:
        other_run.communicate("", timeout=60)
    with OrbaxCheckpointWriter(output_dir=str(tmp_path)) as writer:  # free again
        writer(one_checkpoint())
        with pytest.raises(CheckpointError, match="Another checkpoint writer"):
            lock.DirectoryLock(str(tmp_path), "orbax.").acquire(wait_seconds=0)


def test_an_orbax_writer_made_again_in_one_process_takes_the_earlier_ones_place(tmp_path):
    # A notebook cell run again makes its writer anew while the earlier one,
    # never closed, still holds the directory.
    pytest.importorskip("orbax.checkpoint")
    from flax_loop import OrbaxCheckpointReader, OrbaxCheckpointWriter
    from tests.helpers import MLP

    checkpoint = one_checkpoint()
    earlier = OrbaxCheckpointWriter(output_dir=str(tmp_path), keep=2)
    earlier(checkpoint)  # pending in the background
    newer = OrbaxCheckpointWriter(output_dir=str(tmp_path), keep=2)
    assert OrbaxCheckpointReader(dir=str(tmp_path), target=MLP().init).steps() == [1]  # finished
    with pytest.raises(CheckpointError, match="write through the newer one"):
        earlier(checkpoint)  # the two would prune each other's steps
    newer(checkpoint)
    newer.close()


def test_a_process_of_several_takes_the_orbax_directory_once_it_knows_its_index(
    tmp_path, monkeypatch
):
    # Before jax.distributed.initialize, asking the process index would start
    # JAX's backend and make initialize fail: in a launcher's environment the
    # writer waits for its first write.
    pytest.importorskip("orbax.checkpoint")
    from flax_loop import OrbaxCheckpointWriter

    monkeypatch.setenv("SLURM_NTASKS", "2")
    OrbaxCheckpointWriter(output_dir=str(tmp_path / "several"))
    assert not (tmp_path / "several").exists()
    monkeypatch.setenv("SLURM_NTASKS", "1")
    with OrbaxCheckpointWriter(output_dir=str(tmp_path / "one")):
        assert (tmp_path / "one" / ".lock.orbax.lock").exists()


# -- 10. user text is printed as it is, never read as markup -------------------


def test_brackets_in_paths_and_metric_names_are_printed_as_they_are(tmp_path):
    from tests.helpers import MLP

    directory = tmp_path / "runs" / "[/lr]" / "[bold]x"
    checkpoint = one_checkpoint()
    out = io.StringIO()
    previous = set_console(Console(file=out, width=300))
    try:
        with CheckpointFileWriter(output_dir=str(directory)) as writer:
            writer(checkpoint)
        SummaryLogger()(Summary(metrics={"eval": {"acc[top1]": 0.5}}, **vars(checkpoint)))
        reader = CheckpointFileReader(dir=str(directory), target=MLP().init)
        digits_loop(n_steps=4, n_devices=1, stdout=True, init=reader)
    finally:
        set_console(previous)
    assert "acc[top1]" in out.getvalue()
    assert f"Resumed from step 1 ({directory}/regular.1.ckpt)" in out.getvalue()
    code, listing = cli_output("ls", str(directory))
    assert code == cli.EXIT_OK and "[/lr]" in listing and "[bold]x" in listing


# -- 11, 17. crafted tables and shapes are damage, found cheaply ---------------


def _rewrite_footer(path, change):
    """Rewrites a file's footer (and its checksum) after `change(footer)`."""
    import struct
    import zlib

    import msgpack

    data = bytearray(open(path, "rb").read())
    footer_size, _, end = format.TAIL.unpack(data[-format.TAIL.size :])
    start = len(data) - format.TAIL.size - footer_size
    footer = msgpack.unpackb(bytes(data[start : start + footer_size]), raw=False)
    change(footer)
    packed = msgpack.packb(footer, use_bin_type=True)
    tail = format.TAIL.pack(len(packed), zlib.crc32(packed), end)
    with open(path, "wb") as stream:
        stream.write(bytes(data[:start]) + packed + tail)
    del struct


def test_a_table_of_overlapping_entries_is_damage_read_in_bounded_memory(tmp_path):
    _written(tmp_path, steps=(2,))
    path = tmp_path / "regular.2.ckpt"

    def many_views(footer):
        first = footer["arrays"][0]
        footer["arrays"] = [dict(first) for _ in range(1500)]

    _rewrite_footer(path, many_views)
    with pytest.raises(CheckpointCorruptError, match="overlap"):
        parse.read(str(path))
    code, out = cli_output("verify", str(tmp_path))
    assert code == cli.EXIT_DAMAGED and "overlap" in out


@pytest.mark.parametrize(
    "shape", [[1] * 65, [0, 2**64 - 1]], ids=["65 dimensions", "an extent of 2**64-1"]
)
def test_a_crafted_shape_is_damage_skipped_at_resume(tmp_path, shape):
    _written(tmp_path, steps=(2, 4))

    def crafted(footer):
        footer["arrays"][0]["shape"] = shape
        footer["arrays"][0]["nbytes"] = 0

    _rewrite_footer(tmp_path / "regular.4.ckpt", crafted)
    assert CheckpointFileReader(dir=str(tmp_path), target=None).read_newest().step == 2
    code, out = cli_output("show", str(tmp_path / "regular.4.ckpt"))  # the rest is shown
    assert code == cli.EXIT_DAMAGED and "invalid description" in out and "step: 4" in out


# -- 13, 18. the CLI agrees with what resumes, and never shows a traceback -----


def test_cli_edges_are_answered_not_raised(tmp_path):
    _written(tmp_path, steps=(2,))
    os.symlink(tmp_path / "missing", tmp_path / "regular.3.ckpt")
    code, out = cli_output("verify", str(tmp_path))
    assert code == cli.EXIT_DAMAGED and "regular.3.ckpt" in out and "symbolic link" in out
    (tmp_path / "orbax" / "7").mkdir(parents=True)
    (tmp_path / "orbax" / "²").mkdir()
    code, out = cli_output("show", str(tmp_path / "orbax" / "7"))
    assert code == cli.EXIT_USAGE and "incomplete Orbax step" in out
    code, out = cli_output("show", str(tmp_path / "orbax" / "²"))
    assert code == cli.EXIT_USAGE and "not a checkpoint file or an Orbax step" in out
    code, out = cli_output("ls", str(tmp_path / "orbax"))
    assert code == cli.EXIT_OK and "no checkpoints" in out


def test_listing_races_a_pruning_writer_without_error(tmp_path):
    loop = digits_loop(n_steps=200, n_steps_per_checkpoint=1, n_devices=1)
    stop = threading.Event()
    failures = []

    def lister():
        while not stop.is_set():
            try:
                for entry in list_checkpoints(str(tmp_path)) if tmp_path.exists() else []:
                    assert entry.intact, entry.problem
            except Exception as error:  # noqa: BLE001 - every failure is the finding
                failures.append(repr(error))

    thread = threading.Thread(target=lister)
    thread.start()
    try:
        with CheckpointFileWriter(output_dir=str(tmp_path), keep=1) as writer:
            for checkpoint in loop:
                writer(checkpoint)
    finally:
        stop.set()
        thread.join()
    assert failures == []
    assert np.asarray(file_names(tmp_path)).tolist() == ["regular.200.ckpt"]


# -- 6. Ctrl-C twice while a step waits for its compilation loses nothing ------


def test_ctrl_c_twice_while_a_step_waits_for_its_compilation_loses_no_batch(monkeypatch):
    import optax

    from flax_loop.programs import cache
    from tests.helpers import ResumableBatches, relative_difference

    def run(source):
        return digits_loop(
            data=source,
            optimizer=optax.sgd(0.1),
            n_steps=20,
            n_steps_per_checkpoint=10,
            steps_per_dispatch=4,
            n_devices=1,
        )

    straight = list(run(ResumableBatches(X_TRAIN, Y_TRAIN, 32)))
    compile_now = cache.compiled

    released = threading.Event()  # the background thread's compilations wait for it

    def held_compile(key, compile):
        if threading.current_thread() is not threading.main_thread():
            assert released.wait(60), "the test did not release the compilation"
        return compile_now(key, compile)

    monkeypatch.setattr(cache, "compiled", held_compile)
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        source = ResumableBatches(X_TRAIN, Y_TRAIN, 32)
        loop = run(source)

        def press_twice():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)

        timer = threading.Timer(0.5, press_twice)
        timer.start()
        with pytest.raises(KeyboardInterrupt):  # while its compilation is held
            loop.next_checkpoint()
        assert loop.step == 8  # two groups of 4 ran; the closing group waited
        released.set()
        # The loop goes on, its batch of steps 9-10 put back, not lost.
        first, second = loop.next_checkpoint(), loop.next_checkpoint()
    finally:
        released.set()
        signal.signal(signal.SIGINT, found)
    assert (first.step, second.step) == (10, 20)
    assert not first.preempted and not second.preempted
    assert first.data_state == {"position": 10} and second.data_state == {"position": 20}
    for resumed, expected in zip((first, second), straight):
        assert relative_difference(resumed.model_params, expected.model_params) == 0.0


# -- 7. profiling failures are notes; no batch is lost -------------------------


def _params_after(n_steps, **options):
    from tests.helpers import ResumableBatches

    loop = digits_loop(
        data=ResumableBatches(X_TRAIN, Y_TRAIN, 32),
        n_steps=n_steps,
        n_steps_per_checkpoint=2,
        n_devices=1,
        **options,
    )
    return [checkpoint for checkpoint in loop]


def test_a_trace_that_cannot_start_or_be_written_is_a_note_and_training_goes_on(tmp_path, capsys):
    from flax_loop import ProfileSteps
    from tests.helpers import relative_difference

    straight = _params_after(8)
    # Another trace runs already: the loop's cannot start.
    jax_profiler = pytest.importorskip("jax").profiler
    jax_profiler.start_trace(str(tmp_path / "theirs"))
    try:
        window = ProfileSteps(start=3, n=2, log_dir=str(tmp_path / "ours"))
        checkpoints = _params_after(8, profile=window, stdout=True)
    finally:
        jax_profiler.stop_trace()  # theirs is theirs, untouched
    assert "could not start" in window.problem and "already been started" in window.problem
    assert "Training goes on without it" in capsys.readouterr().out
    for got, expected in zip(checkpoints, straight):
        assert got.data_state == expected.data_state
        assert relative_difference(got.model_params, expected.model_params) == 0.0
    # The trace cannot be written (its directory became a file meanwhile).
    window = ProfileSteps(start=3, n=4, log_dir=str(tmp_path / "gone"))
    loop = digits_loop(n_steps=8, n_steps_per_checkpoint=2, n_devices=1, profile=window)
    for checkpoint in loop:
        if checkpoint.step == 4:  # the trace runs
            import shutil

            shutil.rmtree(tmp_path / "gone")
            (tmp_path / "gone").write_text("a file now")
    assert checkpoint.step == 8 and "could not be written" in window.problem
    # The process can trace again.
    window = ProfileSteps(start=1, n=1, log_dir=str(tmp_path / "again"))
    list(digits_loop(n_steps=2, n_devices=1, profile=window))
    assert window.problem is None and window.traced_steps == [1]


# -- 15. a step that changes a variable's dtype is an error in every layout ----


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_a_variable_whose_dtype_a_step_changes_is_named_in_both_layouts(monkeypatch, packed):
    import flax.linen as nn
    import jax.numpy as jnp

    from flax_loop.errors import ApplyError
    from flax_loop.programs import compiled
    from tests.helpers import MLP

    class Counting(nn.Module):
        @nn.compact
        def __call__(self, x):
            seen = self.variable("counts", "seen", lambda: jnp.zeros(4, jnp.int32))
            if not self.is_initializing():
                seen.value = seen.value + 0.25  # int32 + float: float32
            return MLP()(x)

    if not packed:
        monkeypatch.setattr(compiled, "packing_of", lambda state: None)
    with pytest.raises(ApplyError, match=r"counts/seen: int32\[4\] -> float32\[4\].*astype"):
        digits_loop(Counting(), n_steps=4, n_devices=1, mutable_collections=["counts"])


# -- 14. TensorBoard: a file per writer; a dropped writer closes its file ------


def _summary_at(checkpoint, step, **metrics):
    return Summary(metrics={"eval": metrics}, **{**vars(checkpoint), "step": step})


def test_two_tensorboard_writers_of_one_directory_keep_their_own_files(tmp_path):
    pytest.importorskip("tensorboardX")
    from flax_loop import SummaryWriter
    from tests.test_evaluation import read_events

    checkpoint = one_checkpoint()
    first, second = SummaryWriter(str(tmp_path)), SummaryWriter(str(tmp_path))
    for step in range(1, 21):
        first(_summary_at(checkpoint, step, accuracy=step / 100))
        second(_summary_at(checkpoint, step, f1=step / 50))
    first.close()
    second.close()
    assert len(os.listdir(tmp_path)) == 2
    scalars = read_events(str(tmp_path))  # every record of both files reads back
    assert [step for step, _ in scalars["eval/accuracy"]] == list(range(1, 21))
    assert [step for step, _ in scalars["eval/f1"]] == list(range(1, 21))


def test_a_tensorboard_writer_per_checkpoint_leaks_no_file(tmp_path):
    pytest.importorskip("tensorboardX")
    import gc

    from flax_loop import SummaryWriter

    def open_files():
        return len(os.listdir("/proc/self/fd"))

    checkpoint = one_checkpoint()
    SummaryWriter(str(tmp_path))(_summary_at(checkpoint, 1, accuracy=0.5))
    gc.collect()
    before = open_files()
    for step in range(2, 102):
        SummaryWriter(str(tmp_path))(_summary_at(checkpoint, step, accuracy=0.5))
    gc.collect()
    assert open_files() <= before + 2


# -- 19. JSON lines: any metric a summary holds; a line whole or not at all ----


def test_json_lines_hold_vectors_and_none_and_a_failed_write_leaves_no_partial_line(
    tmp_path, monkeypatch
):
    import errno
    import json

    from flax_loop import JsonLinesWriter
    from flax_loop.errors import MetricError
    from flax_loop.output import jsonlines

    checkpoint = one_checkpoint()
    path = tmp_path / "metrics.jsonl"
    writer = JsonLinesWriter(str(path))
    writer(_summary_at(checkpoint, 1, per_class=np.array([0.5, np.nan]), best=None, name="a"))
    with pytest.raises(MetricError, match="'eval/bad' is object"):
        writer(_summary_at(checkpoint, 2, bad=object()))

    class FullDisk:
        def __getattr__(self, name):
            return getattr(os, name)

        def write(self, descriptor, data):
            os.write(descriptor, data[:7])  # part of the line reaches the disk
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jsonlines, "os", FullDisk())
    with pytest.raises(CheckpointError, match="No space left on device.*intact"):
        writer(_summary_at(checkpoint, 3, accuracy=0.9))
    monkeypatch.undo()
    writer(_summary_at(checkpoint, 4, accuracy=0.95))
    writer.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 4]
    assert records[0]["eval/per_class"] == [0.5, None]
    assert records[0]["eval/best"] is None and records[0]["eval/name"] == "a"


# -- 12, 13. Orbax: failures are CheckpointErrors; an incomplete step is named --


def _orbax_steps(directory, steps=(2, 4)):
    from flax_loop import OrbaxCheckpointWriter

    _written(directory, steps, OrbaxCheckpointWriter)


def test_an_orbax_step_left_incomplete_by_pruning_is_named_and_verify_agrees_with_resume(
    tmp_path,
):
    pytest.importorskip("orbax.checkpoint")
    import shutil

    from flax_loop import OrbaxCheckpointReader

    _orbax_steps(tmp_path)
    shutil.rmtree(tmp_path / "2" / "meta")  # a kill while Orbax deleted step 2
    code, out = cli_output("verify", str(tmp_path))
    assert code == cli.EXIT_OK, out
    assert "incomplete: " in out and "holds no meta" in out and "1 of 2 checkpoints" in out
    assert OrbaxCheckpointReader(dir=str(tmp_path), target=None).steps()[-1] == 4
    shutil.rmtree(tmp_path / "4" / "state")  # now nothing intact resumes
    code, out = cli_output("verify", str(tmp_path))
    assert code == cli.EXIT_DAMAGED, out


def test_an_orbax_failure_on_close_is_a_checkpoint_error_and_frees_the_directory(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    from flax_loop import OrbaxCheckpointWriter

    checkpoint = one_checkpoint()
    writer = OrbaxCheckpointWriter(output_dir=str(tmp_path))
    writer(checkpoint)
    writer.wait()  # the real write is done: what fails below is the stand-in's

    def full_disk():
        raise ValueError("RESOURCE_EXHAUSTED: No space left on device")

    writer.manager.wait_until_finished = full_disk
    with pytest.raises(CheckpointError, match="Orbax failed to finish a write.*RESOURCE_EXHAUSTED"):
        writer.close()
    held = lock.DirectoryLock(str(tmp_path), "orbax.")
    held.acquire(wait_seconds=0)  # released all the same
    held.release()


def test_a_damaged_orbax_step_is_reported_once_without_asyncio_tracebacks(tmp_path, capfd):
    pytest.importorskip("orbax.checkpoint")
    import gc

    from flax_loop import OrbaxCheckpointReader
    from tests.helpers import MLP

    _orbax_steps(tmp_path)
    for root, _, names in os.walk(tmp_path / "4" / "state"):
        for name in names:
            if f"ocdbt.process_0{os.sep}d" in os.path.join(root, name):
                open(os.path.join(root, name), "wb").close()  # the arrays' bytes gone
    capfd.readouterr()
    reader = OrbaxCheckpointReader(dir=str(tmp_path), target=MLP().init)
    loop = digits_loop(n_steps=6, n_steps_per_checkpoint=2, n_devices=1, init=reader)
    gc.collect()
    assert loop.step == 2
    out, err = capfd.readouterr()
    assert out.count("Skipped a damaged Orbax checkpoint") == 1
    assert len(out.splitlines()) == 1 and len(out) < 500  # one line, no TensorStore spec
    assert "never retrieved" not in err and "Event loop is closed" not in err
    assert "Exception ignored" not in err
