"""Inside an interval the host never reads a device array: no transfer, no sync.

`jax.transfer_guard_device_to_host("disallow")` enforces this on accelerators;
on the CPU backend arrays already live in host memory and the guard does not
fire, so the test also spies on `ArrayImpl._value`, through which
`float()`, `int()`, `bool()`, `.item()`, `.tolist()` and `jax.device_get` read
an array (numpy's buffer protocol on CPU arrays bypasses it; flax_loop never
passes device arrays to numpy inside an interval).
"""

import jax
import pytest
from jax._src import array as array_module

from flax_loop.run.interval import Intervals
from tests.helpers import BatchNormDropoutNet, digits_loop


@pytest.fixture
def spy(monkeypatch):
    reads = {"armed": False, "seen": []}
    value = array_module.ArrayImpl._value

    def spied(self):
        if reads["armed"]:
            reads["seen"].append(self.shape)
        return value.fget(self)

    monkeypatch.setattr(array_module.ArrayImpl, "_value", property(spied))
    return reads


@pytest.mark.parametrize("n_devices, steps_per_dispatch", [(1, 1), (4, 1), (4, 3)])
def test_no_device_to_host_read_between_checkpoints(
    spy, monkeypatch, n_devices, steps_per_dispatch
):
    loop = digits_loop(
        BatchNormDropoutNet(),
        n_devices=n_devices,
        n_steps=40,
        n_steps_per_checkpoint=20,
        collections={"apply": ["dropout"]},
        progress=True,
        steps_per_dispatch=steps_per_dispatch,
    )
    make_checkpoint = Intervals.close  # the one place allowed to read the devices

    def checkpoint_allowed(*args):
        # Building the checkpoint reads the loss: that is the one sync allowed.
        spy["armed"] = False
        with jax.transfer_guard_device_to_host("allow"):
            result = make_checkpoint(*args)
        spy["armed"] = True
        return result

    monkeypatch.setattr(Intervals, "close", checkpoint_allowed)
    steps = []
    with jax.transfer_guard_device_to_host("disallow"):
        spy["armed"] = True
        for checkpoint in loop:
            spy["armed"] = False
            steps.append(checkpoint.step)
            spy["armed"] = True
        spy["armed"] = False
    assert steps == [20, 40]
    assert spy["seen"] == []


def test_the_spy_sees_a_host_read(spy):
    array = jax.numpy.arange(3.0) + 1
    spy["armed"] = True
    float(array[0])
    jax.device_get(array)
    array.tolist()
    spy["armed"] = False
    assert spy["seen"] == [(), (3,), (3,)]
