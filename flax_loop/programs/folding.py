r"""The gradients' transposes folded into their products: `folded_dots`.

JAX's derivative of a product `x @ w` with respect to `w` is a product
then a transpose: `dot_general(cotangent, x)` gives `[out, in]`, and a
`transpose` lays it out as `w` is, `[in, out]`. On one device XLA folds
the transpose into the product (the operands swapped). In a program whose
batch is split over several devices, the partitioner places the
gradient's all-reduce right after the product, between it and the
transpose: the fold no longer happens, and every later use of the
gradient (the optimizer's update) reads it transposed. On 4 CPU devices
an Adam step of an MLP 784-512-512-10 took 1.2-1.5x the time of the same
step written per device (`jax.shard_map` and `pmean`), whose all-reduce
comes after the transpose.

`folded_dots` rewrites the step's jaxpr before it is partitioned, as XLA
would on one device: a `transpose` that swaps the free dimensions of the
two operands of a product, the product used by nothing else, becomes the
product of the operands swapped. It is the same sum laid out as the
gradient is; the global program then computes what it computed before
(the same bits, `tests/test_folding.py`) at the per-device program's
speed or better.

>>> import jax, jax.numpy as jnp
>>> def grad(w, x):
...     return jax.grad(lambda w: jnp.sum(x @ w))(w)
>>> w, x = jnp.ones((4, 3)), jnp.ones((8, 4))
>>> def primitives(f):
...     return [e.primitive.name for e in jax.make_jaxpr(f)(w, x).jaxpr.eqns]
>>> primitives(grad)[-2:]
['dot_general', 'transpose']
>>> primitives(folded_dots(grad))[-1:]
['dot_general']
>>> bool(jnp.all(folded_dots(grad)(w, x) == grad(w, x)))
True
"""

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, jaxpr_as_fun
from jax.sharding import NamedSharding, PartitionSpec

NESTING = frozenset(
    ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "scan", "while", "cond")
    + ("custom_jvp_call", "custom_vjp_call")
)
r"""The primitives whose nested jaxprs are folded too: calls, control flow,
rematerialization and custom derivatives, parts of the one program the
partitioner splits. The others are left as written: a `shard_map`'s body
is per-device code (its collectives its own), a kernel's (`pallas_call`)
is lowered by rules of its own that may not take a product's operands
swapped."""


def folded_dots(fn: Callable[..., Any]) -> Callable[..., Any]:
    r"""`fn` with the transposes of its products folded into them, the
    same function of the same arrays (traced once as `fn`, then evaluated
    from its rewritten jaxpr: call it where `fn` would be traced, inside
    `jax.jit`)."""

    def folded(*args: Any) -> Any:
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        outputs = jaxpr_as_fun(_folded_closed(closed))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), outputs)

    return folded


def _folded_closed(closed: ClosedJaxpr) -> ClosedJaxpr:
    jaxpr = _folded(closed.jaxpr)
    return closed if jaxpr is closed.jaxpr else closed.replace(jaxpr=jaxpr)


def _folded(jaxpr: Jaxpr) -> Jaxpr:
    r"""`jaxpr` with its foldable transposes folded, nested jaxprs (of
    `jit`, `scan`, `while`, `cond`, `jax.checkpoint`) too; `jaxpr` itself
    where nothing folds. A fold can make another: a weight used transposed
    (`x @ w.T`, a tied embedding) has its gradient transposed twice."""
    for _ in range(4):
        folded = _folded_once(jaxpr)
        if folded is jaxpr:
            break
        jaxpr = folded
    return jaxpr


def _folded_once(jaxpr: Jaxpr) -> Jaxpr:
    products = _single_use_products(jaxpr)
    eqns: list[JaxprEqn] = []
    folded_away: set[int] = set()
    changed = False
    for eqn in jaxpr.eqns:
        transposes = eqn.primitive.name == "transpose" and not isinstance(eqn.invars[0], Literal)
        product = products.get(eqn.invars[0]) if transposes else None
        swapped = _swapped(product, eqn) if product is not None else None
        if swapped is not None:
            folded_away.add(id(product))
            eqns.append(swapped)
            changed = True
            continue
        params = _with_folded_jaxprs(eqn.params) if eqn.primitive.name in NESTING else eqn.params
        if params is not eqn.params:
            eqn, changed = eqn.replace(params=params), True
        eqns.append(eqn)
    if not changed:
        return jaxpr
    return jaxpr.replace(eqns=[eqn for eqn in eqns if id(eqn) not in folded_away])


def _single_use_products(jaxpr: Jaxpr) -> dict[Any, JaxprEqn]:
    r"""The products without batch dimensions whose result one equation
    uses once (and no output), by that result."""
    uses: dict[Any, int] = {}
    for var in [var for eqn in jaxpr.eqns for var in eqn.invars] + 2 * list(jaxpr.outvars):
        if not isinstance(var, Literal):
            uses[var] = uses.get(var, 0) + 1
    products = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "dot_general":
            continue
        (_, _), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
        if not lhs_batch and not rhs_batch and uses.get(eqn.outvars[0]) == 1:
            products[eqn.outvars[0]] = eqn
    return products


def _swapped(product: JaxprEqn, transpose: JaxprEqn) -> JaxprEqn | None:
    r"""The product of `product`'s operands swapped, giving what
    `transpose` gives, or `None` where the transpose is not the swap of
    the operands' free dimensions (each kept in order)."""
    (lhs_contracting, rhs_contracting), _ = product.params["dimension_numbers"]
    lhs, rhs = product.invars
    n_lhs = len(lhs.aval.shape) - len(lhs_contracting)  # type: ignore[attr-defined]
    n_rhs = len(rhs.aval.shape) - len(rhs_contracting)  # type: ignore[attr-defined]
    swap = tuple(range(n_lhs, n_lhs + n_rhs)) + tuple(range(n_lhs))
    if tuple(transpose.params["permutation"]) != swap:
        return None
    params = dict(product.params, dimension_numbers=((rhs_contracting, lhs_contracting), ((), ())))
    precision = params.get("precision")
    if isinstance(precision, tuple) and len(precision) == 2:  # each operand keeps its own
        params["precision"] = precision[::-1]
    elif isinstance(precision, jax.lax.DotAlgorithm) and (
        (precision.lhs_precision_type, precision.lhs_component_count)
        != (precision.rhs_precision_type, precision.rhs_component_count)
    ):
        return None  # an algorithm that treats its operands apart: left as written
    sharding = params.get("out_sharding")
    if sharding is not None:  # the product's layout under `jax.jit`, transposed too
        spec = tuple(sharding.spec) + (None,) * (n_lhs + n_rhs - len(sharding.spec))
        params["out_sharding"] = NamedSharding(
            sharding.mesh, PartitionSpec(*(spec[i] for i in swap))
        )
    return product.replace(invars=[rhs, lhs], outvars=transpose.outvars, params=params)


def _with_folded_jaxprs(params: dict[str, Any]) -> dict[str, Any]:
    r"""`params` with the nested jaxprs (closed as `jit`'s, `scan`'s and
    `cond`'s branches, open as `jax.checkpoint`'s) folded; `params` itself
    where nothing folds."""
    new = {name: _folded_nested(value) for name, value in params.items()}
    return new if any(new[name] is not params[name] for name in params) else params


def _folded_nested(value: Any) -> Any:
    if isinstance(value, ClosedJaxpr):
        return _folded_closed(value)
    if isinstance(value, Jaxpr):
        return _folded(value)
    if isinstance(value, tuple) and value and all(isinstance(v, ClosedJaxpr) for v in value):
        branches = tuple(_folded_closed(v) for v in value)
        return branches if any(b is not v for b, v in zip(branches, value)) else value
    return value
