"""Several processes with jax.distributed (gloo on CPU), on 127.0.0.1 only.

Every process is bounded by a timeout and killed at the end; ports are free
ones picked by the OS.
"""

import os
import shutil
import socket
import sys
import time

import numpy as np
import pytest

from flax_loop import CheckpointFileReader
from flax_loop.distributed import SILENT_SECONDS
from tests.helpers import assert_same_arrays, file_names, slow, start

TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_all(n_processes, *args):
    """Starts `n_processes` workers, 4 devices in all, joined on a free port."""
    port = free_port()
    return [
        start(
            [
                sys.executable,
                "-m",
                "tests.distributed_worker",
                "--process-id",
                str(index),
                "--num-processes",
                str(n_processes),
                "--port",
                str(port),
                "--devices",
                str(4 // n_processes),
                *map(str, args),
            ]
        )  # fmt: skip
        for index in range(n_processes)
    ]


def stop_all(processes):
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def launch(n_processes, *args, timeout=TIMEOUT):
    """Runs `n_processes` workers to their end; returns their (code, output)."""
    processes = start_all(n_processes, *args)
    deadline = time.monotonic() + timeout
    results = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1))
            results.append((process.returncode, output))
    finally:
        stop_all(processes)
    return results


def succeed(n_processes, *args):
    results = launch(n_processes, *args)
    for code, output in results:
        assert code == 0, output[-4000:]
    return results


def params(path):
    data = np.load(path)
    return {name: data[name] for name in data.files}


def assert_close(a, b, rtol):
    assert a.keys() == b.keys()
    for name in a:
        if name == "step":
            assert int(a[name]) == int(b[name])
            continue
        scale = np.max(np.abs(b[name])) + 1e-12
        assert np.max(np.abs(a[name] - b[name])) / scale < rtol, name


def test_two_processes_compute_what_one_process_computes(tmp_path):
    from tests.helpers import MLP, digits_split

    succeed(1, "--n-steps", 20, "--out", tmp_path / "one.npz", "--eval")
    # the two processes train with your own step doing what the built-in one does
    results = succeed(
        2,
        "--own-step",
        "--n-steps",
        20,
        "--out",
        tmp_path / "two.npz",
        "--eval",
        "--tensorboard",
        tmp_path / "tb",
    )
    one, two = params(tmp_path / "one.npz"), params(tmp_path / "two.npz")
    assert_close(two, one, 1e-6)
    # Exactly one process prints and writes events (process 0).
    assert "Model:" in results[0][1] and "Model:" not in results[1][1]
    assert "Step 20:" in results[0][1] and "Step 20:" not in results[1][1]
    assert len(os.listdir(tmp_path / "tb")) == 1

    # The processes evaluated different numbers of test examples (160 and
    # 140): the accuracy is that of the whole test set, as one process
    # computes it from the final parameters.
    _, _, x_test, y_test = digits_split()
    weights = {
        "params": {
            layer: {"kernel": two[f"{layer}/kernel"], "bias": two[f"{layer}/bias"]}
            for layer in ("Dense_0", "Dense_1")
        }
    }
    logits = np.asarray(MLP().apply(weights, x_test))
    expected = float(np.mean(np.argmax(logits, -1) == y_test))
    assert float(two["accuracy"]) == pytest.approx(expected, abs=1e-6)


@slow(
    "by default two processes run your own step replicated, against one process's "
    "built-in step (test_two_processes_compute_what_one_process_computes)"
)
def test_your_own_step_on_two_processes_sharded_computes_what_the_built_in_one_does(tmp_path):
    # two processes of two devices each, the state split over them (fsdp):
    # the built-in step, then your own step doing the same, bit for bit
    options = ("--n-steps", 10, "--sharding", "fsdp")
    succeed(2, *options, "--out", tmp_path / "built_in.npz")
    succeed(2, *options, "--own-step", "--out", tmp_path / "own.npz")
    own, built_in = params(tmp_path / "own.npz"), params(tmp_path / "built_in.npz")
    assert own.keys() == built_in.keys()
    for name in own:
        np.testing.assert_array_equal(own[name], built_in[name], err_msg=name)


@pytest.fixture(scope="module")
def straight_fsdp_run(tmp_path_factory):
    """One process on 4 devices, fsdp, 20 steps uninterrupted: its parameters,
    and its directory with the files of steps 10 and 20."""
    root = tmp_path_factory.mktemp("straight")
    directory = root / "checkpoints"
    options = ("--sharding", "fsdp", "--dir", directory, "--keep", 2)
    succeed(1, "--n-steps", 20, *options, "--out", root / "one.npz")
    return params(root / "one.npz"), directory


@pytest.mark.parametrize(
    "first, second, sharding",
    [
        # Two processes holding an fsdp state gather it for the file writer.
        (1, 2, "fsdp"),
        pytest.param(
            2,
            1,
            "replicated",
            marks=slow("the other direction"),
        ),
    ],
    ids=["1-to-2-fsdp", "2-to-1"],
)
def test_resume_across_process_counts(tmp_path, first, second, sharding, straight_fsdp_run):
    directory = tmp_path / "checkpoints"
    layout = ("--sharding", sharding)
    if (first, sharding) == (1, "fsdp"):  # the straight run, as if stopped at step 10
        shutil.copytree(straight_fsdp_run[1], directory)
        (directory / "regular.20.ckpt").unlink()
    else:
        succeed(first, "--n-steps", 10, "--dir", directory, *layout)
    assert file_names(directory) == ["regular.10.ckpt"]
    results = succeed(
        second, "--n-steps", 20, "--dir", directory, "--out", tmp_path / "resumed.npz", *layout
    )
    assert all("START 10" in output for _, output in results)
    if sharding == "fsdp":
        straight = straight_fsdp_run[0]
    else:
        succeed(1, "--n-steps", 20, "--out", tmp_path / "straight.npz", *layout)
        straight = params(tmp_path / "straight.npz")
    assert_close(params(tmp_path / "resumed.npz"), straight, 1e-6)
    assert file_names(directory) == ["regular.20.ckpt"]


def test_two_processes_fsdp_write_and_resume_orbax_checkpoints_as_one_process(
    tmp_path, straight_fsdp_run
):
    directory = tmp_path / "orbax"
    sharded = ("--sharding", "fsdp", "--orbax", "--dir", directory)
    results = succeed(2, "--n-steps", 10, *sharded)
    assert all("STEP 10" in output for _, output in results)
    # Each process wrote its own shards of the step (process 0 held the lock).
    assert sorted(os.listdir(directory)) == [".lock.orbax.lock", "10"]
    results = succeed(2, "--n-steps", 20, *sharded, "--out", tmp_path / "two.npz")
    assert all("START 10" in output for _, output in results)
    assert_close(params(tmp_path / "two.npz"), straight_fsdp_run[0], 1e-6)


def test_two_processes_resume_their_grain_shards_bitwise(tmp_path):
    # Each process reads its own examples of one grain pipeline; stopped at
    # step 25 (the newest file removed) and resumed past the end of an epoch
    # (46 batches of 16 per process), both match the straight run bit for bit.
    directory = tmp_path / "ckpts"
    options = ["--grain", "--n-steps", 50, "--every", 25, "--keep", 2, "--dir", directory]
    succeed(2, *options, "--out", tmp_path / "straight.npz")
    assert file_names(directory) == ["regular.25.ckpt", "regular.50.ckpt"]
    newest = CheckpointFileReader(dir=str(directory), target=None).read_newest()
    states = newest.data_state["flax_loop/per_process"]
    # Every process's position, with grain's own iterator state: 50 = 46 + 4.
    grain_position = {"epoch": 1, "batches": 4, "state": {"next_index": 4}}
    assert states == [{"flax_loop/epoch": grain_position}] * 2
    (directory / "regular.50.ckpt").unlink()
    results = succeed(2, *options, "--out", tmp_path / "resumed.npz")
    assert all("START 25" in output for _, output in results)
    assert_same_arrays(tmp_path / "straight.npz", tmp_path / "resumed.npz")


def test_a_bad_batch_on_one_process_stops_every_process(tmp_path):
    started = time.monotonic()
    results = launch(2, "--n-steps", 20, "--bad-batch-at", 5, timeout=120)
    elapsed = time.monotonic() - started
    (code_0, output_0), (code_1, output_1) = results
    assert code_1 != 0 and "BatchError" in output_1 and "(14, 64)" in output_1
    assert code_0 != 0
    assert "process 1 failed" in output_0 and "BatchError" in output_0
    assert elapsed < 120


def test_sigterm_to_one_process_stops_both_at_the_same_checkpoint(tmp_path):
    import signal

    processes = start_all(2, "--n-steps", 200, "--every", 10, "--batch-delay", 0.02)
    try:
        seen = ""
        for line in processes[0].stdout:
            seen += line
            if line.startswith("STEP 10 "):
                processes[1].send_signal(signal.SIGTERM)  # one process only
                break
        outputs = [seen + processes[0].communicate(timeout=TIMEOUT)[0]]
        outputs.append(processes[1].communicate(timeout=TIMEOUT)[0])
    finally:
        stop_all(processes)
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    stops = [
        [line for line in output.splitlines() if line.endswith("preempted")] for output in outputs
    ]
    assert len(stops[0]) == len(stops[1]) == 1, outputs
    assert stops[0][0].split()[1] == stops[1][0].split()[1]  # the same step
    step = int(stops[0][0].split()[1])
    assert 10 < step < 200 and step % 10 == 0
    assert all(f"DONE {step}" in output for output in outputs)


def test_a_damaged_file_seen_by_one_process_stops_every_process(tmp_path):
    import shutil

    succeed(1, "--n-steps", 10, "--dir", tmp_path / "run0")
    shutil.copytree(tmp_path / "run0", tmp_path / "run1")
    damaged = tmp_path / "run1" / "regular.10.ckpt"
    damaged.write_bytes(damaged.read_bytes()[:-100])  # truncated, in process 1's copy only
    started = time.monotonic()
    (code_0, output_0), (code_1, output_1) = launch(
        2, "--n-steps", 20, "--dir", str(tmp_path / "run{process}"), timeout=120
    )
    assert time.monotonic() - started < 120
    assert code_1 != 0 and "CheckpointCorruptError" in output_1
    assert code_0 != 0 and "process 1 failed" in output_0
    assert "CheckpointCorruptError" in output_0


def kill_the_second_at(step, processes, delay=0.0):
    """SIGKILLs process 1 (no word from it, ever) `delay` seconds after
    process 0 says it reached `step`; process 0's output and how long it
    took to end after the kill."""
    import signal

    try:
        for line in processes[0].stdout:
            if line.startswith(f"STEP {step} "):
                time.sleep(delay)
                processes[1].send_signal(signal.SIGKILL)
                killed = time.monotonic()
                break
        output = processes[0].communicate(timeout=TIMEOUT)[0]
        return output, time.monotonic() - killed
    finally:
        stop_all(processes)


def test_a_killed_process_stops_the_other_within_seconds_naming_it(tmp_path):
    # Process 0 is in its loop's body (not in a collective) when 1 is killed.
    processes = start_all(2, "--n-steps", 2000, "--every", 10, "--body-delay", 60)
    output, took = kill_the_second_at(10, processes)
    assert processes[0].returncode == 70, output[-3000:]
    assert "process 1 stopped answering" in output
    assert took < 30  # jax.distributed alone: ~100 s, then SIGABRT


def test_a_process_killed_as_orbax_writes_stops_the_other_within_seconds(tmp_path):
    import signal

    # Killed a few milliseconds after process 0 handed out step 20 and began
    # writing it: process 0 meets the death in the next step's collective
    # (JAX's "connection closed by peer"), in the pending write's barrier, or
    # in its body; it once reported the collective's error as its own and then
    # waited for the write ~95 s until JAX aborted it.
    processes = start_all(
        2, "--n-steps", 2000, "--every", 10, "--orbax", "--dir", tmp_path, "--keep", 2
    )
    output, took = kill_the_second_at(20, processes, delay=0.02)
    assert took < 30, output[-3000:]
    if processes[0].returncode == -signal.SIGABRT:  # gloo's own abort, mid-collective
        assert "gloo" in output, output[-3000:]
    else:
        assert processes[0].returncode == 70, output[-3000:]
        assert "process 1 stopped answering" in output


@slow(
    "by default an error on one process stops every process: a bad batch, a damaged file, "
    "a kill; this one waits out a silent peer's window (SILENT_SECONDS), and on a loaded "
    "machine its two exits can race (process 1 aborted by the coordinator's closing)"
)
def test_a_process_whose_data_ends_early_exits_1_and_the_other_70(tmp_path):
    # Its exit takes longer than a silent peer is given: it goes on beating,
    # and process 0 waits for it.
    slow_exit = SILENT_SECONDS + 0.5
    results = launch(2, "--n-steps", 20, "--data-ends-at", 5, "--slow-exit", slow_exit, timeout=120)
    (code_0, output_0), (code_1, output_1) = results
    assert code_1 == 1 and "DataExhaustedError" in output_1, output_1[-3000:]
    assert code_0 == 70 and "process 1 failed" in output_0, output_0[-3000:]


def test_processes_that_built_other_models_are_told_so_before_a_step():
    results = launch(2, "--n-steps", "2", "--every", "1", "--width-of-process-1", "48")
    assert all(code != 0 for code, _ in results), [output[-2000:] for _, output in results]
    # Every process finds the difference; the first to exit takes the
    # coordinator (process 0 hosts it) down, and JAX may end a slower one
    # before it prints: the message is in one output at least.
    told = [output for _, output in results if "training states differ" in output]
    assert told, [output[-3000:] for _, output in results]
    assert "The processes' training states differ: process 0 has" in told[0]
    assert "['model_params']['Dense_0']['bias'] (64,) float32" in told[0]
    assert "(48,) float32 (the first difference)" in told[0]
