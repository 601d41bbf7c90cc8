"""The weight gradients come out of the global program laid out as the
weights are: the transpose JAX's derivative of a product adds is folded
into the product before the program is split over the devices
(`flax_loop.programs.folding`). Unfolded, the partitioner puts the
gradients' all-reduce between the two and the optimizer reads every
weight gradient transposed (1.2-1.5x the step's time on 4 CPU devices)."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_loop import TrainLoop, TrainTask
from flax_loop.programs.folding import folded_dots

TRANSPOSE = re.compile(r"\} transpose\(")  # an HLO transpose instruction


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(48)(x))
        x = nn.relu(nn.Dense(40)(x))
        return nn.Dense(10)(x)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 24)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)


def adam_step(model, optimizer):
    def step(state, x, y):
        params, opt_state = state
        grads = jax.grad(lambda p: cross_entropy(model.apply(p, x), y))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def transposes(closed):
    """The transpose equations of a jaxpr and of the jaxprs nested in it."""
    jaxpr = closed.jaxpr if isinstance(closed, ClosedJaxpr) else closed
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "transpose"
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple) else (value,):
                if isinstance(inner, (ClosedJaxpr, Jaxpr)):
                    count += transposes(inner)
    return count


def test_a_weight_gradients_transpose_is_folded_into_its_product():
    model, (x, y) = MLP(), data()
    params = model.init(jax.random.key(0), x)

    def grad(params):
        return jax.grad(lambda p: cross_entropy(model.apply(p, x), y))(params)

    assert transposes(jax.make_jaxpr(grad)(params)) == 3  # one a layer
    assert transposes(jax.make_jaxpr(folded_dots(grad))(params)) == 0
    expected, folded = jax.jit(grad)(params), jax.jit(folded_dots(grad))(params)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(folded)):
        np.testing.assert_array_equal(a, b)


def test_products_in_nested_programs_are_folded_and_the_others_kept():
    w, u = jnp.ones((6, 5)), jnp.ones((5, 5))
    x = jnp.arange(4 * 3 * 6, dtype=jnp.float32).reshape(4, 3, 6) / 50

    @jax.jit
    @jax.checkpoint
    def dense(w, x):
        return jnp.tanh(x @ w)

    def recurrent(w, u):  # a scan over time of a layer rematerialized in `jax.jit`
        def cell(h, x_t):
            h = dense(w, x_t) + jnp.tanh(h @ u)
            return h, h

        return jax.lax.scan(cell, jnp.zeros((3, 5)), x)[1].sum()

    grad = jax.grad(recurrent, argnums=(0, 1))
    assert transposes(jax.make_jaxpr(grad)(w, u)) > 0
    assert transposes(jax.make_jaxpr(folded_dots(grad))(w, u)) == 0
    for a, b in zip(jax.jit(grad)(w, u), jax.jit(folded_dots(grad))(w, u)):
        np.testing.assert_allclose(a, b, rtol=1e-6)

    def tied(w, x):  # a weight used transposed: its gradient transposed twice
        return jnp.sum(jnp.tanh(x[0] @ w.T))

    e = jnp.full((5, 6), 0.1)
    tied_grad = jax.grad(tied)
    assert transposes(jax.make_jaxpr(tied_grad)(e, x)) == 3
    assert transposes(jax.make_jaxpr(folded_dots(tied_grad))(e, x)) == 1  # `w.T` itself
    np.testing.assert_array_equal(jax.jit(tied_grad)(e, x), jax.jit(folded_dots(tied_grad))(e, x))

    def precise(w, x):  # each operand keeps its precision when they swap
        highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT)
        product = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=highest)
        return jnp.sum(jnp.tanh(product))

    folded = jax.make_jaxpr(folded_dots(jax.grad(precise)))(w, x[0])
    (last,) = [eqn for eqn in folded.jaxpr.eqns if eqn.outvars == folded.jaxpr.outvars]
    assert last.primitive.name == "dot_general"
    assert last.params["precision"] == (jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST)

    def used_twice(a, b):  # the product is needed as it is: left alone
        p = a @ b
        return p.T, p

    def batched(a, b):  # a product with batch dimensions: XLA lays it out itself
        return jnp.swapaxes(jnp.matmul(a, b), 1, 2)

    uneven = jax.lax.DotAlgorithm(jnp.bfloat16, jnp.float32, jnp.float32)

    def apart(a, b):  # an algorithm that treats its operands apart: as written
        return jax.grad(lambda b: jnp.sum(jax.lax.dot(a, b, precision=uneven)))(b)

    mesh = Mesh(np.array(jax.devices()), ("data",))

    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec()
    )
    def per_device(a, b):  # per-device code, its collectives its own: as written
        return jax.grad(lambda b: jnp.sum(jnp.tanh(a @ b)))(b)

    a, b = jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))
    kept = ((used_twice, (a[0], b[0])), (batched, (a, b)), (apart, (a[0], b[0])))
    for fn, args in (*kept, (per_device, (a[0], b[0]))):
        closed = jax.make_jaxpr(folded_dots(fn))(*args)
        assert transposes(closed) == transposes(jax.make_jaxpr(fn)(*args)) == 1


def test_the_split_program_reads_no_gradient_transposed_and_computes_the_same_bits():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    assert mesh.size == 4
    whole, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    model, optimizer, (x, y) = MLP(), optax.adam(1e-2), data()
    params = model.init(jax.random.key(0), x)
    step = adam_step(model, optimizer)

    def run(fn):
        program = jax.jit(fn, in_shardings=(whole, split, split), out_shardings=whole)
        state = jax.device_put((params, optimizer.init(params)), whole)
        x_, y_ = jax.device_put(x, split), jax.device_put(y, split)
        text = program.lower(state, x_, y_).compile().as_text()
        for _ in range(3):
            state = program(state, x_, y_)
        return len(TRANSPOSE.findall(text)), state

    (unfolded, expected), (folded, state) = run(step), run(folded_dots(step))
    assert unfolded > 0 and folded == 0
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)


def test_the_loops_program_on_several_devices_reads_no_gradient_transposed():
    x, y = data(128)
    loop = TrainLoop(
        init=MLP().init,
        task=TrainTask(
            apply=MLP().apply,
            optimizer=optax.adam(1e-2),
            loss=cross_entropy,
            data=iter([(x[i : i + 32], y[i : i + 32]) for i in range(0, 128, 32)]),
        ),
        rnkey=jax.random.key(1),
        n_steps=4,
        n_steps_per_checkpoint=2,
        stdout=False,
        prefetch=0,
    )
    assert len(jax.devices()) == 4
    checkpoints = list(loop)
    loop.compiled.wait()
    programs = loop.compiled.programs.values()
    texts = [program.as_text() for program in programs if hasattr(program, "as_text")]
    assert texts and all("all-reduce" in text for text in texts)
    assert sum(len(TRANSPOSE.findall(text)) for text in texts) == 0
    assert [c.step for c in checkpoints] == [2, 4]
