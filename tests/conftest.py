"""Test set-up: 4 forced CPU devices, set before JAX is imported."""

import os
import shutil
import sys
import tempfile

from tests.flags import QUICK_COMPILE

# The suite compiles hundreds of small programs, and compiling is most of its
# time; XLA's CPU backend compiles them faster with the flags of
# `QUICK_COMPILE` (nothing the tests assert depends on them: numbers agree to
# their tolerances, runs compared bit for bit are compiled alike).
# FLAX_LOOP_SLOW=1 runs with XLA's defaults. Worker processes inherit the
# flags (tests.flags.xla_flags).
OPTIMIZATION = "" if os.environ.get("FLAX_LOOP_SLOW") else " " + " ".join(QUICK_COMPILE)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4" + OPTIMIZATION
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite builds the same small models again and again, in this process and
# in the worker processes it starts (which inherit these variables): JAX's
# persistent compilation cache compiles each only once (README: "Start fast").
# The process that makes the directory (the first, which xdist's workers
# inherit it from) removes it at the end.
OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    OWN_CACHE = tempfile.mkdtemp(prefix="flax_loop-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Worker processes read the digits from here rather than import scikit-learn.
os.environ.setdefault(
    "FLAX_LOOP_DIGITS",
    os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], "digits.npz"),
)

# The suite starts many fresh Python processes (the guides, the examples,
# several processes, kills and resumes): let them keep the
# bytecode of the modules they compile (flax_loop's, the tests' helpers)
# rather than compile them again in each (about 0.15 s a process). The
# files go where Python puts them, in __pycache__ folders git ignores.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# MLflow 3 refuses its local file store unless told; the tests use it (no
# server, no database), as the issue of metric stores asks.
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

import jax  # noqa: E402
import pytest  # noqa: E402

# JAX_PLATFORMS set to an accelerator runs the tests written for any device
# there (benchmarks/on_device.sh: tests/test_accelerator.py)
if jax.default_backend() == "cpu":
    assert len(jax.devices()) == 4, jax.devices()


@pytest.fixture
def devices() -> list:
    return jax.devices()


@pytest.fixture
def one_device(monkeypatch):
    """`jax.devices()` as a reader's CPU has them: one. The suite forces four
    CPU devices for its multi-device tests, where a step costs 8 to 13 times a
    one-device step (collectives between threads on two cores); a program
    that leaves the devices to flax_loop then trains on one, as the reader's
    does (on four it computes the same: tests/test_loop.py)."""
    one = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda backend=None: one)


@pytest.fixture(autouse=True)
def fresh_console():
    """Every test starts and ends with flax_loop printing to the current stdout."""
    from flax_loop import set_console

    set_console(None)
    yield
    set_console(None)


@pytest.fixture
def without_compilation_cache():
    """For tests that count or time compilations: every compilation really compiles
    (JAX's persistent cache off, flax_loop's programs of earlier loops forgotten).

    JAX decides whether to use the cache once per process, so the decision is
    reset on both sides of the change (a config update alone changes nothing).
    """
    from jax.experimental.compilation_cache import compilation_cache

    from flax_loop.programs import cache

    cache.clear()  # nor the programs an earlier loop of this process compiled
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


def pytest_unconfigure(config):
    if OWN_CACHE is not None:
        shutil.rmtree(OWN_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _training_allowed():
    """A test's stop by signal ends its process's training (as a script's
    does), and the checkpoints it wrote are the process's newest (which the
    stop's message names): the next test in the worker starts clean."""
    yield
    from flax_loop import clear_stop
    from flax_loop.checkpoint.format import WRITTEN

    clear_stop()
    WRITTEN.clear()
