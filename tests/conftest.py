"""Test set-up: 4 forced CPU devices, set before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
