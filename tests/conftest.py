"""Test set-up: 4 forced CPU devices, set before JAX is imported."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite builds the same small models again and again, in this process and
# in the worker processes it starts (which inherit these variables): JAX's
# persistent compilation cache compiles each only once (README: "Start fast").
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="flax_loop-jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

assert len(jax.devices()) == 4, jax.devices()


@pytest.fixture
def devices() -> list:
    return jax.devices()


@pytest.fixture(autouse=True)
def fresh_console():
    """Every test starts and ends with flax_loop printing to the current stdout."""
    from flax_loop import set_console

    set_console(None)
    yield
    set_console(None)


@pytest.fixture
def without_compilation_cache():
    """For tests that count compilations: every compilation really compiles."""
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", True)
