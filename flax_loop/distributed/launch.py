r"""Joining a job's processes: `initialize_processes`."""

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import jax

from flax_loop.errors import ConfigError

_MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")


def initialize_processes(**options: Any) -> None:
    r"""Joins this process to the others of its job: `jax.distributed.initialize`
    with the launcher's environment.

    Without arguments JAX reads SLURM's (`srun`) and Open MPI 4's
    (`mpirun`) variables. Open MPI 5's `mpirun` no longer sets the variable
    JAX finds its coordinator with; under it (and under other MPI
    launchers) the processes find it through MPI itself (mpi4py, which must
    be installed). `options` go to `jax.distributed.initialize` as they
    are (say `coordinator_address=`, `num_processes=`, `process_id=`).

    The processes wait `initialization_timeout` seconds for each other
    (`INITIALIZATION_TIMEOUT` by default, JAX's own is 300). Process 0 checks
    first that the coordinator's port is free: JAX's coordinator dies
    without a word on a port in use, leaving the others to wait. A process
    still waiting a moment before the timeout says for what, naming the
    coordinator's address, before JAX ends it (JAX aborts the process
    then, saying only "Deadline Exceeded").

    Raises:
        ConfigError: under an MPI launcher without mpi4py, naming both
            remedies; on process 0, for a coordinator port in use.
    """
    given = dict(options)
    options.setdefault("initialization_timeout", INITIALIZATION_TIMEOUT)
    if options.get("process_id") == 0 and options.get("coordinator_address"):
        _check_port_free(str(options["coordinator_address"]))
    try:
        with _last_word_before_the_timeout(options):
            jax.distributed.initialize(**options)
        return
    except ValueError as error:
        launched_by_mpi = any(name in os.environ for name in _MPI_VARIABLES)
        if given or not launched_by_mpi or "coordinator_address" not in str(error):
            raise
    try:
        import mpi4py  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            "This process was started by an MPI launcher that does not tell JAX where "
            "its coordinator is (Open MPI 5's mpirun). Install mpi4py (pip install "
            "mpi4py), through which the processes find it, or pass "
            "coordinator_address='host of process 0:port', num_processes= and "
            "process_id=."
        ) from error
    jax.distributed.initialize(
        cluster_detection_method="mpi4py", initialization_timeout=INITIALIZATION_TIMEOUT
    )


INITIALIZATION_TIMEOUT = 120
r"""Seconds `initialize_processes` waits for every process to join, by default."""

_COUNTS_OF_PROCESSES = (
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "PMIX_SIZE",
    "JAX_NUM_PROCESSES",
)
r"""Launchers' variables holding the number of processes they started."""


def main_process_if_known() -> bool | None:
    r"""Whether this process is process 0, where that is known without
    starting JAX's backend (which would make a later
    `jax.distributed.initialize` fail): after `jax.distributed.initialize`,
    or without a launcher's environment of several processes (then it is
    the only one); `None` in a launcher's environment before
    `jax.distributed.initialize`."""
    if jax.distributed.is_initialized():
        return jax.process_index() == 0
    for name in _COUNTS_OF_PROCESSES:
        try:
            if int(os.environ.get(name, "1")) > 1:
                return None
        except ValueError:
            continue
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return None
    return True


def _check_port_free(address: str) -> None:
    r"""Raises a `ConfigError` naming `address` when its port is taken here."""
    import socket

    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return  # JAX says what is wrong with the address
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # a port a finished run's connections linger on is free; a listener's is not
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("", int(port)))
    except OSError as error:
        raise ConfigError(
            f"The coordinator's port {port} ({address!r}) is in use on this host "
            f"({error.strerror}): another job, or a process left from an earlier run, "
            "holds it. Give every process another coordinator_address port, or end "
            "that process."
        ) from None
    finally:
        probe.close()


@contextlib.contextmanager
def _last_word_before_the_timeout(options: dict[str, Any]) -> Iterator[None]:
    r"""While `jax.distributed.initialize(**options)` runs: shortly before its
    `initialization_timeout`, one line on stderr naming what this process
    waits for, since JAX then aborts it without naming the address."""
    timeout = float(options["initialization_timeout"])
    address = options.get("coordinator_address") or "the address the launcher gave"
    process = options.get("process_id")
    if process == 0:
        waits_for = f"the other processes to join its coordinator at {address}"
    else:
        who = "this process" if process is None else f"process {process}"
        waits_for = f"the coordinator at {address} (process 0) to answer {who}"
    message = (
        f"flax_loop: has waited {{:.0f}} s for {waits_for}. If process 0 failed, its "
        "output says why (a coordinator port in use is named there); if the port is "
        "another program's, give every process another coordinator_address. JAX ends "
        f"this process at the {timeout:.0f} s initialization_timeout.\n"
    )
    done = threading.Event()
    before = max(timeout - min(5.0, timeout / 10), 0.0)

    def say() -> None:
        if not done.is_set():
            sys.stderr.write(message.format(before))
            sys.stderr.flush()

    warning = threading.Timer(before, say)
    warning.daemon = True
    warning.start()
    try:
        yield
    finally:
        done.set()
        warning.cancel()
