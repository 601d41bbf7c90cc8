r"""The training state carried between steps as a few flat arrays.

Each array a compiled call takes or returns costs the host a fixed amount
(argument checks, buffer bookkeeping, a Python object for each output;
benchmarks/README.md, "Packed state", measures it). A small model's state
has dozens of leaves (a kernel and a bias per layer, and their two Adam
moments), which make most of its step. So the leaves of a replicated state
of at most `MAX_LEAF_BYTES` each travel between steps concatenated, one flat
array per dtype; inside the compiled step they are slices of it again
(`Packing.unpack`), and what the step computes is unchanged up to float
rounding (a BatchNorm and Dropout net's parameters bit for bit; an MLP
40-1500-4 with Adam within 4e-7 relative after 30 steps, XLA summing a
bias's gradient in another order: tests/test_packing.py). Whether a state
is packed depends on its shapes and dtypes alone, so two runs of one model
always share a layout, and the loop's bitwise guarantees hold. Larger
leaves travel as they are: concatenating them would cost each step a copy
(an MLP 784-512-512-10 packed whole ran at 0.70 of its unpacked speed).

>>> state = {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3), "count": jnp.zeros((), jnp.int32)}
>>> packing = Packing(state)
>>> packed = packing.pack(state)
>>> [leaf.shape for leaf in jax.tree.leaves(packed)]
[(9,), (1,)]
>>> packing.unpack(packed)["kernel"].shape
(2, 3)
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_LEAF_BYTES = 16 * 1024
r"""Leaves of at most this many bytes are packed (benchmarks/README.md,
"Packed state": concatenating larger ones costs more than it saves)."""

MAX_STATE_BYTES = 1 << 20
r"""A state of more bytes than this travels unpacked; its step is long enough
that the arrays a call passes are no measurable part of it, and packed
against unpacked runs of such a CNN (benchmarks/loop_overhead.py) could
not tell a gain from a loss."""


class _Slot(NamedTuple):
    group: int  # the flat array it is in
    offset: int
    size: int
    shape: tuple[int, ...]


class Packing:
    r"""A layout of a state's leaves: the small ones in one flat array per dtype.

    Args:
        state: the state (arrays or `jax.ShapeDtypeStruct`s) whose structure
            and leaf types every packed state has.
        max_leaf_bytes: the largest leaf packed.

    Weak-typed leaves and leaves of extended dtypes (typed PRNG keys) travel
    as they are: a slice of a flat array would lose what makes them so.
    """

    def __init__(self, state: Any, max_leaf_bytes: int = MAX_LEAF_BYTES) -> None:
        leaves, self.treedef = jax.tree.flatten(state)
        self.dtypes: list[np.dtype] = []
        sizes: list[int] = []
        self._slots: list[_Slot | None] = []
        for leaf in leaves:
            dtype = np.dtype(leaf.dtype) if _packable(leaf, max_leaf_bytes) else None
            if dtype is None:
                self._slots.append(None)
                continue
            if dtype not in self.dtypes:
                self.dtypes.append(dtype)
                sizes.append(0)
            group = self.dtypes.index(dtype)
            size = math.prod(leaf.shape)
            self._slots.append(_Slot(group, sizes[group], size, tuple(leaf.shape)))
            sizes[group] += size
        self.n_packed = sum(slot is not None for slot in self._slots)
        r"""the number of leaves packed."""

    def pack(self, state: Any) -> tuple[tuple[jax.Array, ...], tuple[Any, ...]]:
        r"""`(flat arrays, the leaves not packed)`: traceable; `state` must
        have the layout's structure."""
        leaves, treedef = jax.tree.flatten(state)
        if treedef != self.treedef:  # type: ignore[operator]
            raise LayoutChanged(state)
        parts: list[list[jax.Array]] = [[] for _ in self.dtypes]
        kept = []
        for leaf, slot in zip(leaves, self._slots):
            if slot is None:
                kept.append(leaf)
            else:
                parts[slot.group].append(jnp.reshape(leaf.astype(self.dtypes[slot.group]), -1))
        return tuple(jnp.concatenate(part) for part in parts), tuple(kept)

    def unpack(self, packed: tuple[tuple[jax.Array, ...], tuple[Any, ...]]) -> Any:
        r"""The state `pack` was given: traceable."""
        flats, kept = packed
        remaining = iter(kept)
        leaves = [
            next(remaining)
            if slot is None
            else jax.lax.slice_in_dim(
                flats[slot.group], slot.offset, slot.offset + slot.size
            ).reshape(slot.shape)
            for slot in self._slots
        ]
        return jax.tree.unflatten(self.treedef, leaves)


def on_packed(fn: Callable[..., Any], packing: "Packing | None") -> Callable[..., Any]:
    r"""`fn(state, *args) -> (state, *outputs)` taking and returning the state
    packed in `packing` (`fn` itself without one)."""
    if packing is None:
        return fn

    def packed_fn(packed: Any, *args: Any) -> Any:
        state, *outputs = fn(packing.unpack(packed), *args)
        return (packing.pack(state), *outputs)

    return packed_fn


class LayoutChanged(Exception):
    r"""Raised while tracing when a step returns a state of another structure
    than it took (the loss reported metrics the state had no sums for)."""

    def __init__(self, state: Any) -> None:
        super().__init__("the step returned a state of another structure")
        self.state = state


def _packable(leaf: Any, max_leaf_bytes: int) -> bool:
    dtype = leaf.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) or getattr(leaf, "weak_type", False):
        return False
    return math.prod(leaf.shape) * np.dtype(dtype).itemsize <= max_leaf_bytes


def packing_of(state: Any) -> Packing | None:
    r"""The state's packing; `None` for a state of more than `MAX_STATE_BYTES`,
    or one with fewer than two leaves to pack."""
    if sum(leaf.nbytes for leaf in jax.tree.leaves(state)) > MAX_STATE_BYTES:
        return None
    packing = Packing(state)
    return packing if packing.n_packed >= 2 else None
