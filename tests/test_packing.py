"""The state travels between steps packed into a few flat arrays, and computes the same."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flax_loop.programs.compiled
from flax_loop.programs.packing import LayoutChanged, Packing
from tests.helpers import MLP, BatchNormDropoutNet, digits_loop


def test_pack_then_unpack_gives_back_every_leaf_exactly():
    state = {
        "kernel": jnp.arange(12.0).reshape(3, 4),
        "bias": jnp.full(4, -0.5, jnp.bfloat16),
        "count": jnp.asarray(7, jnp.int32),
        "scale": jnp.asarray([1.5, 2.5], jnp.bfloat16),
        "seen": jnp.asarray([True, False]),
        "big": jnp.ones((64, 65)),  # 16,640 bytes: beyond MAX_LEAF_BYTES
        "weak": jnp.asarray(0.25),  # a Python float's weak type
        "key": jax.random.key(1),  # an extended dtype
    }
    packing = Packing(state)
    flats, kept = packing.pack(state)
    # kernel | bias + scale | count | seen: one flat array per dtype
    assert sorted((str(a.dtype), a.shape) for a in flats) == [
        ("bfloat16", (6,)),
        ("bool", (2,)),
        ("float32", (12,)),
        ("int32", (1,)),
    ]
    assert packing.n_packed == 5 and len(kept) == 3
    back = packing.unpack((flats, kept))
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for name, leaf in state.items():
        if name == "key":
            assert jnp.array_equal(jax.random.key_data(back[name]), jax.random.key_data(leaf))
            continue
        assert back[name].dtype == leaf.dtype and back[name].shape == leaf.shape, name
        assert np.array_equal(np.asarray(back[name]), np.asarray(leaf)), name
    assert back["weak"].weak_type


def test_a_step_that_returns_another_structure_is_reported():
    packing = Packing({"a": jnp.ones(2), "b": jnp.ones(3)})
    with pytest.raises(LayoutChanged):
        packing.pack({"a": jnp.ones(2), "b": jnp.ones(3), "c": jnp.ones(1)})


def _final(monkeypatch, packed, **options):
    if not packed:
        monkeypatch.setattr(flax_loop.programs.compiled, "packing_of", lambda state: None)
    loop = digits_loop(
        BatchNormDropoutNet(),
        collections={"apply": ["dropout"]},
        n_steps=12,
        **options,
    )
    checkpoints = list(loop)
    monkeypatch.undo()
    last = checkpoints[-1]
    leaves = jax.device_get((last.model_params, last.model_state, last.optimizer_state))
    return loop, checkpoints, [np.asarray(leaf) for leaf in jax.tree.leaves(leaves)]


@pytest.mark.parametrize(
    "n_devices, options",
    [
        (1, {"n_steps_per_checkpoint": 12, "steps_per_dispatch": 4, "ema_decay": 0.9}),
        (4, {"n_steps_per_checkpoint": 3}),
    ],
)
def test_packed_state_trains_bitwise_as_the_unpacked(monkeypatch, n_devices, options):
    loop, checkpoints, packed = _final(monkeypatch, True, n_devices=n_devices, **options)
    assert loop.compiled.packing is not None
    # every leaf of this small net is packed: one array of each dtype a call
    assert len(jax.tree.leaves(loop.compiled.state)) == 2
    unpacked_loop, unpacked_checkpoints, unpacked = _final(
        monkeypatch, False, n_devices=n_devices, **options
    )
    assert unpacked_loop.compiled.packing is None
    assert len(packed) == len(unpacked) > 10
    assert all(np.array_equal(a, b) for a, b in zip(packed, unpacked))
    np.testing.assert_array_equal(
        np.concatenate([c.losses for c in checkpoints]),
        np.concatenate([c.losses for c in unpacked_checkpoints]),
    )
    if "ema_decay" in options:
        for a, b in zip(
            jax.tree.leaves(checkpoints[-1].ema_params),
            jax.tree.leaves(unpacked_checkpoints[-1].ema_params),
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoints_keep_their_values_while_the_loop_trains_on():
    # the 64x128 kernel travels apart from the packed leaves: both kinds
    loop = digits_loop(MLP(features=(128,)), n_steps=6, n_steps_per_checkpoint=2)
    checkpoints = list(loop)
    assert loop.compiled.packing is not None
    seen = [
        [np.asarray(leaf).copy() for leaf in jax.tree.leaves(c.model_params)] for c in checkpoints
    ]
    # the loop donated its state to the later steps: the checkpoints' arrays
    # are their own
    for checkpoint, values in zip(checkpoints, seen):
        leaves = jax.tree.leaves(checkpoint.model_params)
        assert not any(leaf.is_deleted() for leaf in leaves)
        for leaf, value in zip(leaves, values):
            np.testing.assert_array_equal(np.asarray(leaf), value)
    assert all(not np.array_equal(a, b) for a, b in zip(seen[0], seen[-1]))


def test_a_large_leaf_travels_as_it_is():
    loop = digits_loop(MLP(features=(128,)), optimizer=optax.sgd(0.1), n_steps=2)
    list(loop)
    # the 64x128 kernel (32 KB) is not packed; its bias and the rest are
    _, kept = loop.compiled.state
    assert [leaf.shape for leaf in kept] == [(64, 128)]


def test_a_large_state_travels_unpacked():
    from flax_loop.programs.packing import MAX_STATE_BYTES

    loop = digits_loop(MLP(features=(2048,)), n_steps=2)  # Adam: ~1.8 MB of state
    # the state the first step takes is on the devices, its counters too
    # (made on the host, placed with the state where no packing program runs)
    start = jax.tree.leaves(loop.compiled.state)
    assert all(isinstance(leaf, jax.Array) and leaf.committed for leaf in start)
    *_, checkpoint = list(loop)
    assert loop.compiled.packing is None
    state_bytes = 3 * sum(leaf.nbytes for leaf in jax.tree.leaves(checkpoint.model_params))
    assert state_bytes > MAX_STATE_BYTES
    assert np.isfinite(checkpoint.loss)


class _Wide(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(self.width)(x)))


def _wide_params(monkeypatch, width, packed):
    from flax_loop import TrainLoop, TrainTask

    if not packed:
        monkeypatch.setattr(flax_loop.programs.compiled, "packing_of", lambda state: None)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 40)).astype(np.float32)
    y = rng.integers(0, 4, 64).astype(np.int32)
    model = _Wide(width)
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(
            model.apply,
            optax.adam(1e-3),
            lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
                logits, labels
            ).mean(),
            iter(lambda: (x, y), None),
        ),
        rnkey=jax.random.key(0),
        n_steps=30,
        n_steps_per_checkpoint=30,
        stdout=False,
        devices=jax.devices()[:1],
    )
    checkpoint = loop.next_checkpoint()
    monkeypatch.undo()
    return loop.compiled.packing is not None, checkpoint.model_params


@pytest.mark.parametrize("width", [1000, 1900, 2000])
def test_packed_and_unpacked_agree_to_rounding_near_the_size_cap(monkeypatch, width):
    from tests.helpers import relative_difference

    packed, params = _wide_params(monkeypatch, width, packed=True)
    # Adam's three copies of 45 * width floats: packed up to the 1 MiB cap
    assert packed == (width < 1940)
    unpacked = _wide_params(monkeypatch, width, packed=False)[1]
    assert relative_difference(params, unpacked) < 1e-6
    if width == 1900:  # the two layouts may differ in the last bits; one is exact
        again = _wide_params(monkeypatch, width, packed=True)[1]
        assert relative_difference(params, again) == 0.0
    if width in (1000, 2000):  # packed with its second kernel, or not packed
        assert relative_difference(params, unpacked) == 0.0
