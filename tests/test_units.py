"""The pure pieces, each against a reference: the update, key derivation,
the finite check, interval statistics and the file format."""

import functools
import io

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec

from flax_loop.checkpoint import format, parse
from flax_loop.parallel import DATA_AXIS
from flax_loop.programs.state import TrainState, close_interval
from flax_loop.programs.statistics import build_update
from flax_loop.random import eval_key, init_key, step_keys, train_key
from flax_loop.step.nonfinite import all_finite
from tests.helpers import MLP, cross_entropy, digits_split

X, Y, _, _ = digits_split()
MODEL = MLP(features=(16,))
BATCH = ((X[:32],), (Y[:32],))


@functools.cache
def params():
    """The MLP's initial parameters (made when a test first asks: not at collection)."""
    return MODEL.init(jax.random.key(0), X[:1])["params"]


def state_of(optimizer, step=0):
    fields = {
        "model_params": params(),
        "model_state": {},
        "optimizer_state": optimizer.init(params()),
    }
    return TrainState.create(fields, step=step)


def sgd_state(lr=0.1):
    return state_of(optax.sgd(lr))


def test_update_is_one_sgd_step():
    update, _ = build_update(MODEL.apply, cross_entropy, optax.sgd(0.1), [], False, None)
    state, (loss, grads) = jax.jit(update)(sgd_state(), BATCH, jax.random.key(0))

    def reference_loss(params):
        return cross_entropy(MODEL.apply({"params": params}, X[:32]), Y[:32])

    expected_loss, expected_grads = jax.value_and_grad(reference_loss)(params())
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params(), expected_grads)
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), grads, expected_grads
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        state.model_params,
        expected,
    )
    assert state.counters.tolist() == [1, 0, 0]
    assert float(state.loss_sum) == pytest.approx(float(expected_loss), rel=1e-6)


def test_per_device_update_with_pmean_equals_the_global_update():
    mesh = Mesh(np.array(jax.devices()), (DATA_AXIS,))
    local, _ = build_update(MODEL.apply, cross_entropy, optax.sgd(0.1), [], False, None)
    per_device, _ = build_update(MODEL.apply, cross_entropy, optax.sgd(0.1), [], False, DATA_AXIS)
    sharded = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(DATA_AXIS), PartitionSpec()),
        out_specs=PartitionSpec(),
        check_vma=False,
    )
    one, _ = jax.jit(local)(sgd_state(), BATCH, jax.random.key(0))
    four, _ = jax.jit(sharded)(sgd_state(), BATCH, jax.random.key(0))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        one.model_params,
        four.model_params,
    )


def test_skipping_a_nonfinite_step_keeps_params_and_optimizer_state():
    def nan_loss(logits, labels):
        return cross_entropy(logits, labels) * jnp.nan

    update, _ = build_update(MODEL.apply, nan_loss, optax.adam(0.1), [], False, None, skip=True)
    state = state_of(optax.adam(0.1), step=3)
    new, _ = jax.jit(update)(state, BATCH, jax.random.key(0))
    assert new.counters.tolist() == [4, 1, 4]
    jax.tree.map(np.testing.assert_array_equal, new.model_params, params())
    jax.tree.map(np.testing.assert_array_equal, new.optimizer_state, state.optimizer_state)
    assert float(new.loss_sum) == 0.0


def test_close_interval_reports_and_resets():
    state = sgd_state()._replace(
        counters=jnp.asarray([12, 2, 9], jnp.int32), loss_sum=jnp.asarray(3.5, jnp.float32)
    )
    reset, statistics = close_interval(state, params())
    assert statistics.counters.tolist() == [12, 2, 9]
    assert float(statistics.loss_sum) == 3.5 and bool(statistics.finite)
    assert reset.counters.tolist() == [12, 0, 0] and float(reset.loss_sum) == 0.0
    _, with_nan = close_interval(state, jax.tree.map(lambda g: g * jnp.nan, params()))
    assert not bool(with_nan.finite)


def test_key_derivation_matches_fold_in_chains():
    key = jax.random.key(42)
    data = jax.random.key_data
    np.testing.assert_array_equal(data(init_key(key)), data(jax.random.fold_in(key, 0)))
    np.testing.assert_array_equal(data(train_key(key)), data(jax.random.fold_in(key, 1)))
    keys = step_keys(train_key(key), 5, 2, ["dropout", "noise"])
    reference = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, 1), 5), 2)
    np.testing.assert_array_equal(data(keys["dropout"]), data(jax.random.fold_in(reference, 0)))
    np.testing.assert_array_equal(data(keys["noise"]), data(jax.random.fold_in(reference, 1)))
    np.testing.assert_array_equal(
        data(eval_key(key, 7, 3)), data(jax.random.fold_in(jax.random.fold_in(key, 7), 3))
    )
    # Steps and devices get different keys.
    others = [step_keys(train_key(key), s, d, ["dropout"])["dropout"] for s, d in [(5, 3), (6, 2)]]
    assert all(not np.array_equal(data(o), data(keys["dropout"])) for o in others)


def test_all_finite_looks_at_floating_leaves_only():
    assert bool(all_finite({"a": jnp.ones(3), "n": jnp.asarray(-1, jnp.int32)}))
    assert not bool(all_finite({"a": jnp.asarray([1.0, jnp.inf])}))
    assert not bool(all_finite([jnp.asarray(jnp.nan, jnp.bfloat16)]))
    assert bool(all_finite({}))


def test_file_format_round_trip_is_exact_and_deterministic(tmp_path):
    tree = {
        "model_params": {
            "w": np.arange(12, dtype=np.float32).reshape(3, 4),
            "b": np.asarray(1.5, ml_dtypes.bfloat16),
            "layers": [np.zeros((0, 2), np.float64), np.asarray([True, False])],
        },
        "optimizer_state": {"count": np.asarray(7, np.int32), "empty": {}},
    }
    meta = {"step": 7, "metrics": {"eval": {"accuracy": 0.5}}, "data_state": {"position": [1, 2]}}
    first, second = io.BytesIO(), io.BytesIO()
    format.write(first, tree, meta)
    format.write(second, tree, meta)
    assert first.getvalue() == second.getvalue()
    path = tmp_path / "regular.7.ckpt"
    path.write_bytes(first.getvalue())
    read_tree, read_meta = parse.read(str(path))
    assert read_meta["step"] == 7 and read_meta["data_state"] == {"position": [1, 2]}
    assert read_meta["metrics"] == {"eval": {"accuracy": 0.5}}
    flat_in, flat_out = jax.tree.leaves(tree), jax.tree.leaves(read_tree)
    assert len(flat_in) == len(flat_out)
    for a, b in zip(flat_in, flat_out):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
