r"""Programs run once (an initialization, the state's packing at set-up),
compiled for a short compilation, and the abstract arrays their keys and
lowerings take: `run_once`, `run_once_options`, `abstract`, `as_placed`.
"""

import os
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from flax_loop.programs import cache
from flax_loop.programs.cache import identity, signature


def abstract(leaf: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    r"""`leaf`'s shape and dtype, with `sharding` (by default its own); an
    abstract leaf of that sharding as it is."""
    if isinstance(leaf, jax.ShapeDtypeStruct) and (sharding is None or sharding == leaf.sharding):
        return leaf
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding or leaf.sharding)


def as_placed(tree: Any, sharding: Any) -> Any:
    r"""`tree` with each host (numpy) array as the abstract array it becomes
    placed with `sharding`: a state whose host arrays its packing program
    transfers is keyed, lowered and shaped as the placed state."""
    return jax.tree.map(
        lambda leaf: abstract(leaf, sharding) if isinstance(leaf, np.ndarray) else leaf, tree
    )


_LEVEL = "xla_backend_optimization_level"


def run_once(
    fn: Callable[..., Any],
    out_shardings: Any,
    *args: Any,
    key: Hashable | None = None,
    like: tuple[Any, ...] | None = None,
    signed: Hashable | None = None,
) -> Any:
    r"""`jax.jit(fn, out_shardings=out_shardings)(*args)` for a program run
    once (an initialization), compiled with `run_once_options()`; with a
    `key` (what determines `fn`: `flax_loop.programs.cache`), compiled once a
    process for the arguments' shapes, or for those of `like` (the
    arguments as placed: `as_placed`); `signed`, their signature when
    known."""
    shapes = args if like is None else like

    def compile() -> Any:
        lowered = jax.jit(fn, out_shardings=out_shardings).lower(*shapes)
        return lowered.compile(compiler_options=run_once_options())

    if key is not None:
        signed = signature(shapes) if signed is None else signed
        key = ("run once", key, signed, identity(out_shardings))
    return cache.compiled(key, compile)(*args)


def run_once_options() -> dict[str, Any] | None:
    r"""XLA options for a program run once.

    XLA's CPU backend spends most of an initialization's compilation
    optimizing code that runs once (the initializers' threefry hashes, at
    LLVM's highest level by default): at level 2 a 3-conv CNN's init
    compiles in 0.9 s instead of 3.6 s, runs as fast, and gives the same
    values bit for bit (tests/test_startup.py). A level set in `XLA_FLAGS`
    is kept; other backends compile with their defaults.
    """
    if jax.default_backend() != "cpu" or _LEVEL in os.environ.get("XLA_FLAGS", ""):
        return None
    return {_LEVEL: 2}
