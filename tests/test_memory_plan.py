"""`loop.memory_plan()`: each device's bytes before the first step, against
the bytes the devices then hold; a plan over a device's limit is refused."""

import jax
import numpy as np
import pytest

from flax_loop.errors import ConfigError
from flax_loop.run import memory
from tests.helpers import MLP, digits_loop

WIDE = MLP(features=(512, 256))


def bytes_on(tree, device):
    """The bytes of a tree's arrays held on `device`, as the devices report them."""
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def wide_loop(n_devices, **options):
    return digits_loop(WIDE, n_steps=4, n_devices=n_devices, ema_decay=0.99, **options)


@pytest.mark.parametrize("n_devices, sharding", [(1, "replicated"), (4, "replicated"), (4, "fsdp")])
def test_the_plan_is_what_the_devices_hold(n_devices, sharding):
    loop = wide_loop(n_devices, sharding=sharding, fsdp_min_bytes=0)
    plan = loop.memory_plan()
    checkpoint = loop.next_checkpoint()
    for device in jax.devices()[:n_devices]:
        assert plan["params"] == bytes_on(checkpoint.model_params, device)
        assert plan["optimizer_state"] == bytes_on(checkpoint.optimizer_state, device)
        assert plan["ema_params"] == bytes_on(checkpoint.ema_params, device)
    # a batch of 32 rows of 64 float32 inputs and int32 labels, split over the devices
    assert plan["batch"] == 32 * (64 + 1) * 4 // n_devices
    assert plan["checkpoint"] == plan["params"] + plan["optimizer_state"] + plan["ema_params"]
    assert plan["temporaries"] > 0
    assert plan["total"] == sum(value for part, value in plan.items() if part != "total")


def test_fsdp_holds_a_quarter_of_the_state_a_device():
    replicated = wide_loop(4, sharding="replicated").memory_plan()
    fsdp = wide_loop(4, sharding="fsdp", fsdp_min_bytes=0).memory_plan()
    full = replicated["params"] + replicated["optimizer_state"] + replicated["ema_params"]
    split = fsdp["params"] + fsdp["optimizer_state"] + fsdp["ema_params"]
    assert split == pytest.approx(full / 4, rel=0.01)


def test_stacked_steps_hold_their_batches_and_set_up_prints_the_plan(capsys):
    loop = wide_loop(1, steps_per_dispatch=4, stdout=True)
    plan = loop.memory_plan()
    assert plan["batch"] == 4 * 32 * (64 + 1) * 4
    out = capsys.readouterr().out
    assert f"Memory: {memory.format_plan(plan)}" in out


def test_a_plan_over_the_devices_memory_is_refused_before_training(monkeypatch):
    total = wide_loop(1).memory_plan()["total"]
    monkeypatch.setattr(memory, "device_limit", lambda device: total - 1)
    with pytest.raises(ConfigError) as caught:
        wide_loop(1)
    message = str(caught.value)
    assert "Training would need " in message and "a device: " not in message
    assert (
        'Try sharding="fsdp" (each device holds a share of the state), a smaller batch' in message
    )
    assert "steps_per_dispatch=1" in message
    monkeypatch.setattr(memory, "device_limit", lambda device: total)
    *_, last = wide_loop(1)  # exactly the limit fits
    assert last.step == 4


def test_devices_that_hold_different_bytes_get_a_plan_each():
    devices = jax.devices()[:2]
    mesh_1d = jax.make_mesh((2,), ("data",), devices=devices)
    odd = jax.ShapeDtypeStruct(
        (3, 8),
        np.float32,
        sharding=jax.sharding.NamedSharding(mesh_1d, jax.sharding.PartitionSpec()),
    )
    only_first = jax.ShapeDtypeStruct(
        (4,), np.float32, sharding=jax.sharding.SingleDeviceSharding(devices[0])
    )
    state = {
        "model_params": [odd, only_first],
        "model_state": {},
        "optimizer_state": (),
        "ema_params": None,
    }
    plan = memory.plan(state, {}, [], devices)
    assert set(plan) == {str(devices[0]), str(devices[1])}
    assert plan[str(devices[0])]["params"] == 3 * 8 * 4 + 16
    assert plan[str(devices[1])]["params"] == 3 * 8 * 4
