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
