r"""One step variant lowered for the devices: `lower_update`.

The update (`flax_loop.step`) becomes a program: one step, a
`jax.lax.scan` over stacked batches, or the interval's closing step, which
also returns its gradients and the interval's statistics. It is one global
program: written for the whole batch and the whole state, as on one
device, and laid out by `jax.jit`'s shardings (the state's, replicated or
sharded; the batch split along the batch axis), the compiler placing the
collectives (the gradients' all-reduce among them). A step written for one
device (`PER_DEVICE_MODES`: a model or loss that names the batch axis)
runs under `jax.shard_map` instead. The state is donated, and a replicated
one travels packed (`flax_loop.programs.packing`).

>>> import jax, optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop.programs.lowering import lower_update
>>> from flax_loop.parallel import Placement
>>> from flax_loop.programs.state import TrainState
>>> from flax_loop.programs.statistics import build_update
>>> def loss(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> model = nn.Dense(3)
>>> x, y = np.ones((8, 4), np.float32), np.zeros(8, np.int32)
>>> params = model.init(jax.random.key(0), x)["params"]
>>> update, step = build_update(model.apply, loss, optax.sgd(0.1), rng_labels=[],
...                             mutable_collections=False, axis_name=None)
>>> fields = {"model_params": params, "model_state": {},
...           "optimizer_state": optax.sgd(0.1).init(params)}
>>> state = TrainState.create(fields, step=0)
>>> one_device = Placement(jax.devices()[:1])
>>> lowered = lower_update(update, one_device, state, ((x,), (y,)), jax.random.key(0))
>>> state, loss = lowered.compile()(state, ((x,), (y,)), jax.random.key(0))
>>> int(state.step), loss.shape
(1, ())
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from flax_loop.data.batch import Batch
from flax_loop.parallel import Placement
from flax_loop.programs.folding import folded_dots
from flax_loop.programs.packing import LayoutChanged, Packing, on_packed
from flax_loop.programs.state import TrainState, close_interval
from flax_loop.programs.statistics import Update

UPDATE_MODES = ("jit", "global", "shard_map", "gspmd")
PER_DEVICE_MODES = ("shard_map", "gspmd")
r"""The modes of a step written per device (`jax.lax.pmean` over the batch
axis): a replicated state under `shard_map`, a sharded one mapped over the
batch's shards in one program (`flax_loop.step.gradient`)."""


def lower_update(
    update: Update,
    placement: Placement,
    state: TrainState,
    batch: Batch,
    key: jax.Array,
    n_steps: int = 1,
    with_grads: bool = False,
    mode: str = "jit",
    shardings: TrainState | None = None,
    closing: bool = False,
    packing: Packing | None = None,
    grads_like: Callable[[Any], Any] | None = None,
) -> jax.stages.Lowered:
    r"""Lowers the update for the placement, donating the state: the program
    to compile (tracing errors of the model or the loss are raised here).

    Args:
        update: the per-device update (`flax_loop.programs.statistics.counted`).
        placement: the devices to run on.
        state: the state (used for its shapes and layout).
        batch: a batch (used for its shapes and layout); with `n_steps > 1`,
            `n_steps` batches stacked along a new leading axis.
        key: the replicated key.
        n_steps: steps per call; more than one runs them in a `jax.lax.scan`
            over the stacked batches, returning every step's loss.
        with_grads: whether the call also returns the (last step's) gradients
            (with `n_steps > 1`, only with `closing`).
        mode: how the update runs over the devices: `"jit"` (one device, no
            collectives), `"global"` (the update of the whole batch laid out
            by the state's and the batch's shardings, the compiler placing
            the collectives), or a step written per device
            (`PER_DEVICE_MODES`): `"shard_map"` (a replicated state: the
            update runs on every device's share, binding the placement's
            batch axis) or `"gspmd"` (a sharded state: an update built with
            `shards` maps itself over the batch's shards in one program).
        shardings: the state's `NamedSharding` objects, or `None` for a
            replicated state.
        closing: (with `with_grads`) the interval's last step: it also closes
            the interval (`close_interval`: its statistics, its sums reset),
            in the same program, so a checkpoint costs no further dispatch.
            With `n_steps > 1`, the scan runs all steps but the last, which
            runs as the single closing step does.
        packing: the layout the state is packed in (`state` is then the
            packed state, taken and returned so), or `None`.
        grads_like: maps a tree shaped as the parameters to one shaped as
            the gradients (`Objective.grads_like`: trainable parts, several
            optimizers'); the parameters' shape by default.

    Returns:
        the lowered `update(state, batch, key) -> (state, loss)`, or
        `-> (state, loss, grads)` with `with_grads`, `-> (state, loss, grads,
        statistics)` with `closing` too (`loss` the vector of every step's
        loss with `n_steps > 1`); compiled, it accepts only arrays of these
        shapes.

    Raises:
        LayoutChanged: (while tracing) if the step returns a state of another
            structure than `state` (sums of metrics the loss reports): lower
            again from a state that has them.
    """
    assert packing is None or shardings is None, "a sharded state is never packed"
    stacked = n_steps > 1
    assert not stacked or with_grads == closing, "several steps return gradients only to close"

    if mode == "global" and placement.n_devices > 1:
        update = folded_dots(update)  # the gradients laid out as on one device
    steps = _program(update, stacked, with_grads, closing, packing)
    n_outputs = 4 if closing else 3 if with_grads else 2
    batch_layout = placement.batch_shardings(batch, stacked)
    jitted = _over_devices(steps, placement, mode, shardings, batch_layout, n_outputs, grads_like)
    return jitted.lower(state, batch, key)


def _program(
    update: Update, stacked: bool, with_grads: bool, closing: bool, packing: Packing | None
) -> Callable[..., Any]:
    r"""The variant's program `(state, batch, key) -> outputs`, before it is
    placed on the devices (`_over_devices`): one step, a scan of several,
    or the interval's closing step(s), as `lower_update` describes them."""

    def one_step(state: TrainState, batch: Batch, key: jax.Array) -> Any:
        new_state, outputs = update(state, batch, key)
        if jax.tree.structure(new_state) != jax.tree.structure(state):  # type: ignore[operator]
            raise LayoutChanged(new_state)
        return new_state, outputs

    def scanned_steps(state: Any, batches: Batch, key: jax.Array) -> Any:
        def body(state: TrainState, batch: Batch) -> tuple[TrainState, jax.Array]:
            state, (loss, _) = one_step(state, batch, key)
            return state, loss

        # The scan carries the state packed, as the single step does: the
        # slices and the concatenation then fuse into the update's own loops
        # (unpacked before the scan, they were copies of their own each call).
        return jax.lax.scan(on_packed(body, packing), state, batches)  # every step's loss

    def single_step(state: TrainState, batch: Batch, key: jax.Array) -> Any:
        state, (loss, grads) = one_step(state, batch, key)
        if with_grads:
            grads = jax.tree.map(_returned, grads)
        if closing:
            state, statistics = close_interval(state, grads)
            return state, loss, grads, statistics
        return (state, loss, grads) if with_grads else (state, loss)

    def closing_steps(state: Any, batches: Batch, key: jax.Array) -> Any:
        # The interval's last step computes what it computes alone (its
        # gradients materialized as in every step), after a scan of the others.
        head, tail = (
            jax.tree.map(lambda leaf: leaf[:-1], batches),
            jax.tree.map(lambda leaf: leaf[-1], batches),
        )
        barrier = jax.lax.optimization_barrier
        state, head = barrier((state, head))
        state, losses = scanned_steps(state, head, key)
        state, tail = barrier((state, tail))
        state, loss, grads, statistics = on_packed(single_step, packing)(state, tail, key)
        return state, jnp.concatenate([losses, loss[None]]), grads, statistics

    if stacked:
        return closing_steps if closing else scanned_steps
    return on_packed(single_step, packing)


def _over_devices(
    steps: Callable[..., Any],
    placement: Placement,
    mode: str,
    shardings: TrainState | None,
    batch_layout: Any,
    n_outputs: int,
    grads_like: Callable[[Any], Any] | None,
) -> Any:
    r"""`steps(state, batch, key)` jitted for the placement in `mode` (as
    `lower_update` takes them), the state donated; `batch_layout` the
    batch's shardings (`Placement.batch_shardings`); `n_outputs` the number
    of values it returns (state, loss, and gradients and statistics)."""
    replicated = placement.replicated
    if mode == "shard_map":
        # check_vma=False keeps pmap's semantics: per-device gradients, then an
        # explicit pmean. With the default, differentiating w.r.t. replicated
        # parameters already sums over the axis and the update is N times too
        # large (tests/test_loop.py compares 4 devices with 1 under plain SGD).
        batch_spec = jax.tree.map(lambda sharding: sharding.spec, batch_layout)
        steps = jax.shard_map(
            steps,
            mesh=placement.mesh,
            in_specs=(PartitionSpec(), batch_spec, PartitionSpec()),
            out_specs=PartitionSpec(),
            check_vma=False,
        )
    if mode in ("jit", "shard_map"):
        return jax.jit(steps, donate_argnums=0, out_shardings=replicated)
    # One program over the whole batch, its layout given as data: the state
    # as laid out (replicated: one sharding for the whole tree), the batch
    # split along the batch axis.
    if shardings is None:
        state_shardings: Any = replicated
        grads_shardings: Any = replicated
    else:
        state_shardings = shardings
        grads_shardings = (grads_like or (lambda tree: tree))(shardings.model_params)
    outputs = (state_shardings, replicated, grads_shardings, replicated)
    return jax.jit(
        steps,
        donate_argnums=0,
        in_shardings=(state_shardings, batch_layout, replicated),
        out_shardings=outputs[:n_outputs],
    )


def _returned(gradient: jax.Array) -> jax.Array:
    r"""The gradient as the closing step returns it: the same bits, computed
    by an elementwise op of its own.

    A gradient the program returns as it is must be written out whole where
    it is computed, and XLA then fuses its producers otherwise than in a
    step that only applies it: with a gradient summed over several paths (a
    loss calling the model twice, tied weights) the updates differed in the
    last bits (tests/test_cadence.py, "general"). Read by a fusion of its
    own, the gradient's producers stay as every other step has them.
    `copysign(abs(g), g)` is `g` for every value, infinities and NaNs too.
    """
    if not jnp.issubdtype(gradient.dtype, jnp.inexact):
        return gradient
    return jnp.copysign(jnp.abs(gradient), gradient)
