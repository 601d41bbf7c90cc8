r"""The step's variants lowered and compiled: the pieces `CompiledSteps` is made of.

`Variants` lowers the plan's variants of the update for the placement (the
first one at set-up, which settles the state's final form: packed, with a
sum for each metric the step reports); `Compiling` is a program compiling
on the background thread or when first called.
"""

import concurrent.futures
import functools
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_loop.data.batch import Batch
from flax_loop.data.feed import LAST, MANY, MANY_LAST, DispatchPlan
from flax_loop.parallel import Placement
from flax_loop.programs import cache
from flax_loop.programs.cache import signature
from flax_loop.programs.lowering import PER_DEVICE_MODES, lower_update
from flax_loop.programs.once import abstract, as_placed, run_once, run_once_options
from flax_loop.programs.packing import LayoutChanged, Packing, on_packed, packing_of
from flax_loop.programs.state import TrainState, close_interval
from flax_loop.programs.statistics import Update

_POLL_SECONDS = 0.05


class Compiling:
    r"""A program compiling on the background thread (`source` its future), or
    compiled when first called (`source` compiles it): called, it waits for
    the executable, puts it in `programs` under `name`, if given (later
    calls go straight to it), and runs it. While it waits, `interrupted()`
    (if given) is asked every 50 ms; once true, it raises `KeyboardInterrupt`
    without running anything."""

    def __init__(
        self,
        source: concurrent.futures.Future | Callable[[], Any],
        programs: dict[str, Any] | None = None,
        name: str = "",
        interrupted: Callable[[], Callable[[], bool] | None] = lambda: None,
        waited: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self._source, self._programs, self._name = source, programs, name
        self._interrupted, self._waited = interrupted, waited
        self._compiled: Any = None

    @property
    def status(self) -> str:
        r"""`"compiled"`, `"compiling"` (on the background thread) or `"on first
        call"` (compiled when first called)."""
        if self._compiled is not None:
            return "compiled"
        return (
            "compiling" if isinstance(self._source, concurrent.futures.Future) else "on first call"
        )

    def result(self) -> Callable[..., Any]:
        if self._compiled is None:
            source = self._source
            started = time.perf_counter()
            self._compiled = (
                self._wait(source) if isinstance(source, concurrent.futures.Future) else source()
            )
            self._waited(time.perf_counter() - started)
        if self._programs is not None and self._programs.get(self._name) is self:
            self._programs[self._name] = self._compiled
        return self._compiled

    def __call__(self, *args: Any) -> Any:
        return self.result()(*args)

    def _wait(self, future: concurrent.futures.Future) -> Any:
        interrupted = self._interrupted()
        while interrupted is not None:
            try:
                return future.result(timeout=_POLL_SECONDS)
            except concurrent.futures.TimeoutError:
                if interrupted():
                    raise KeyboardInterrupt from None
        return future.result()


def lower_variant(
    lower_with: Callable[..., Any],
    name: str,
    state: Any,
    key: Any,
    plan: DispatchPlan,
    batches: tuple[Batch, Batch | None, Batch | None],
) -> Any:
    r"""Lowers the plan's variant `name` from `state`; `batches` holds a
    batch, the stacked group and the closing group (`None` if not planned)."""
    batch, stacked, closing = batches
    if name == MANY:
        assert stacked is not None
        return lower_with(state, stacked, key, n_steps=plan.steps_per_dispatch)
    if name == MANY_LAST:
        assert closing is not None
        n_steps = plan.closing_steps
        return lower_with(state, closing, key, n_steps=n_steps, with_grads=True, closing=True)
    last = name == LAST  # it closes the interval too
    return lower_with(state, batch, key, with_grads=last, closing=last)


def with_sums(
    state: TrainState, shardings: TrainState | None, names: Any, placement: Placement
) -> tuple[TrainState, TrainState | None]:
    r"""The state and its shardings with a zero sum for each metric the loss reports."""
    zeros = {name: np.zeros((), np.float32) for name in names}
    state = state._replace(metric_sums=placement.replicate(zeros))
    if shardings is not None:
        shardings = shardings._replace(metric_sums={name: placement.replicated for name in names})
    return state, shardings


class Variants:
    r"""Lowers the plan's variants of `update` for the placement (`lower`),
    the first one at set-up (`first`), which settles the state's final form."""

    def __init__(
        self,
        update: Update,
        placement: Placement,
        key: jax.Array,
        plan: DispatchPlan,
        batches: tuple[Batch, Batch | None, Batch | None],
        grads_like: Callable[[Any], Any],
        program_key: Hashable | None = None,
        per_device: Callable[[], Update] | None = None,
    ) -> None:
        self.update, self.placement, self.key, self.plan = update, placement, key, plan
        r"""the update the programs run: the global one, until `first` finds a
        step written per device."""
        self.batches, self.grads_like = batches, grads_like
        self.program_key = program_key
        self.per_device = per_device
        r"""builds the update written per device (`None`: the update is the
        only one), for a model or loss that names the batch axis."""
        r"""what determines the programs but their arguments' shapes, or `None`
        (compile every program: `flax_loop.programs.cache`)."""
        self._planned: tuple[Any, ...] | None = None
        self._signed: tuple[Any, Hashable] | None = None  # (tree, its signature)
        self.unpacked: Hashable = None
        r"""the unpacked state's signature (the programs unpack it), once
        `first` settled it."""
        self.unpacked_shapes: Any = None
        r"""the unpacked state's shapes, dtypes and shardings, once `first`
        settled it (`jax.ShapeDtypeStruct`)."""

    def cache_key(self, *parts: Any) -> Hashable | None:
        r"""A program's cache key: the task's, the state's unpacked form, the
        plan, the batches and the key it was planned with, and `parts`."""
        if self.program_key is None:
            return None
        if self._planned is None:  # what every key shares, once
            plan = (self.plan.steps_per_dispatch, self.plan.closing_steps)
            self._planned = (self.program_key, plan, signature(self.batches), signature(self.key))
        return (*self._planned, self.unpacked, *parts)

    def signature_of(self, tree: Any) -> Hashable:
        r"""`signature(tree)`, kept for the tree last asked for (the state's
        shapes, which every later program's key names)."""
        signed = self._signed  # (read once: the compiling thread asks too)
        if signed is None or signed[0] is not tree:
            signed = self._signed = (tree, signature(tree))
        return signed[1]

    def compiled(
        self,
        name: str,
        state: Any,
        shardings: TrainState | None,
        mode: str,
        packing: Packing | None,
    ) -> Any:
        r"""The variant `name` compiled (once a process for its key)."""
        key = self.cache_key("variant", name, mode, self.signature_of(state), signature(shardings))
        return cache.compiled(
            key, lambda: self.lower(name, state, shardings, mode, packing).compile()
        )

    def lower(
        self,
        name: str,
        state: Any,
        shardings: TrainState | None,
        mode: str,
        packing: Packing | None,
    ) -> jax.stages.Lowered:
        r"""The variant `name` lowered from `state` (packed with `packing`)."""
        lower_with = functools.partial(
            lower_update,
            self.update,
            self.placement,
            mode=mode,
            shardings=shardings,
            packing=packing,
            grads_like=self.grads_like,
        )
        return lower_variant(lower_with, name, state, self.key, self.plan, self.batches)

    def closing_group(
        self,
        size: int,
        lower: Callable[..., jax.stages.Lowered],
        state: Any,
        shardings: TrainState | None,
        stacked: Batch,
    ) -> Callable[[], Any]:
        r"""`compile()` of the interval's closing group of `size` steps (a
        changed cadence's), `lower` the placement's `lower_update`, `stacked`
        a planned group of batches (their shapes but the group's size)."""
        closing = jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(
                (size, *leaf.shape[1:]), leaf.dtype, sharding=getattr(leaf, "sharding", None)
            ),
            stacked,
        )
        key = self.cache_key("closing group", size, self.signature_of(state), signature(shardings))

        def compile() -> Any:
            lowered = lower(state, closing, n_steps=size, with_grads=True, closing=True)
            return lowered.compile()

        return lambda: cache.compiled(key, compile)

    def first(
        self, name: str, state: TrainState, shardings: TrainState | None, packing: Packing | None
    ) -> tuple[Any, Callable[[], Any], TrainState, TrainState | None, Packing | None, str]:
        r"""The first variant lowered: `(packed state, compile, state,
        shardings, packing, mode)`, `compile()` its program, the state with
        a sum for each metric the step reports, and the mode the placement
        and the model need. A re-run of a step this process lowered before
        takes what that first lowering found, and lowers nothing."""
        placement = self.placement
        mode = "global" if shardings is not None or placement.n_devices > 1 else "jit"
        placed = as_placed(state, placement.replicated)
        placed_signature = signature(placed)
        signed: tuple[Any, Hashable] | None = (placed, placed_signature)
        first_key = self.cache_key("first", name, placed_signature, signature(shardings))
        known = cache.found(first_key)
        if known is not None:
            mode, names = known
            if mode in PER_DEVICE_MODES:
                self._per_device()
            if names is not None:
                state, shardings = with_sums(state, shardings, names, placement)
                packing = packing_of(state) if packing is not None else None
                signed = None  # another state
            packed = self._packed(state, packing, shardings, signed)
            compile = self._compile_first(name, packed, shardings, mode, packing)
            return packed, compile, state, shardings, packing, mode

        def lowered() -> jax.stages.Lowered:
            # from the shapes: the state is packed once, its layout settled
            shapes = self._packed_shapes(state, packing)
            return self.lower(name, shapes, shardings, mode, packing)

        try:
            try:
                program = lowered()
            except NameError as error:
                # A model or loss that names the batch axis (BatchNorm(axis_name=
                # "data"), all_gather, psum) is written per device: run it so,
                # binding the axis. Only the step's trace says whether it does.
                unbound = f"unbound axis name: {placement.batch_axis}"
                if self.per_device is None or unbound not in str(error):
                    raise
                self._per_device()
                mode = "gspmd" if shardings is not None else "shard_map"
                program = lowered()
        except LayoutChanged as changed:  # the step reports metrics: carry their sums
            names = tuple(changed.state.metric_sums)
            state, shardings = with_sums(state, shardings, names, placement)
            if packing is not None:
                packing = packing_of(state)
            program = lowered()
            signed = None  # another state
        else:
            names = None
        packed = self._packed(state, packing, shardings, signed)
        cache.keep(first_key, (mode, names))
        key = self.cache_key(
            "variant", name, mode, signature(jax.tree.map(abstract, packed)), signature(shardings)
        )
        return packed, lambda: cache.compiled(key, program.compile), state, shardings, packing, mode

    def _per_device(self) -> None:
        r"""From now on, the update written per device."""
        assert self.per_device is not None, "only a step that has one runs per device"
        self.update = self.per_device()

    def _packed_shapes(self, state: TrainState, packing: Packing | None) -> Any:
        r"""The shapes and layout of the state as the programs take it."""
        replicated = self.placement.replicated
        if packing is None:
            return jax.tree.map(abstract, as_placed(state, replicated))
        on_devices = functools.partial(abstract, sharding=replicated)
        return jax.tree.map(on_devices, jax.eval_shape(packing.pack, state))

    def _packed(
        self,
        state: TrainState,
        packing: Packing | None,
        shardings: TrainState | None,
        signed: tuple[Any, Hashable] | None = None,
    ) -> Any:
        r"""The state as the programs take it, on the devices: packed, when it
        travels so, by a program whose call also transfers the host's arrays
        that a replicated state keeps there (`flax_loop.run.initial.placed`);
        else those arrays replicated. `signed`: `as_placed(state)` and its
        signature, when known."""
        replicated = self.placement.replicated
        if signed is None:
            shapes = as_placed(state, replicated)
            signed = (shapes, signature(shapes))
        shapes, self.unpacked = signed
        self.unpacked_shapes = jax.tree.map(abstract, shapes)
        if packing is not None:
            key = ("pack", self.unpacked)
            return run_once(
                packing.pack, replicated, state, key=key, like=(shapes,), signed=self.unpacked
            )
        return state if shardings is not None else self.placement.replicate(state)

    def _compile_first(
        self,
        name: str,
        packed: Any,
        shardings: TrainState | None,
        mode: str,
        packing: Packing | None,
    ) -> Callable[[], Any]:
        shapes = jax.tree.map(abstract, packed)
        return lambda: self.compiled(name, shapes, shardings, mode, packing)


def compile_close(packing: Packing | None, shardings: Any, state: Any, grads: Any) -> Any:
    r"""The interval's separate close (`close_interval`) compiled for the
    state's layout (`state`, `grads`: their shapes), `shardings` those of its
    outputs."""
    close = jax.jit(on_packed(close_interval, packing), donate_argnums=0, out_shardings=shardings)
    return close.lower(state, grads).compile()


def compile_copy(
    packing: Packing | None, placement: Placement, shapes: Any, key: Hashable | None
) -> Callable[[Any], dict[str, Any]]:
    r"""`copy(state)`: the saved state's arrays as fresh arrays in their
    layout (a packed state unpacked, replicated), `shapes` the state's as
    the steps take it, by one compiled program: its outputs are buffers of
    its own (its input is not donated), which outlive the loop's donation
    of its own to the next step. One dispatch instead of one a leaf: a
    transfer a leaf cost a small model's interval more host time than its
    steps."""

    def copy(state: Any) -> dict[str, Any]:
        unpacked = state if packing is None else packing.unpack(state)
        return jax.tree.map(jnp.copy, unpacked.saved_arrays())

    if packing is None:
        layout = jax.tree.map(lambda leaf: leaf.sharding, shapes.saved_arrays())
    else:
        layout = placement.replicated
    # slices and copies: compiled as the initial state is, for a short compilation
    return cache.compiled(
        key,
        lambda: jax.jit(copy, out_shardings=layout).lower(shapes).compile(run_once_options()),
    )


def with_fields(
    packing: Packing | None, unpacked: Any, packed: Any, key: Hashable | None
) -> Callable[[Any, dict[str, Any]], Any]:
    r"""`replaced(state, fields)`: a state as the steps take it holding
    `fields` instead of its own (`unpacked`, `packed`: the state's shapes
    and layouts, unpacked and as the steps take it)."""
    if packing is None:
        shardings = jax.tree.map(lambda leaf: leaf.sharding, unpacked.fields)
        return lambda state, fields: state._replace(fields=jax.device_put(fields, shardings))

    def replaced(state: Any, fields: dict[str, Any]) -> Any:
        return packing.pack(packing.unpack(state)._replace(fields=fields))

    shardings = jax.tree.map(lambda leaf: leaf.sharding, packed)
    program = jax.jit(replaced, out_shardings=shardings)
    return cache.compiled(key, lambda: program) if key is not None else program
