r"""The update compiled in the variants a `DispatchPlan` calls, and when each compiles.

The variants (`flax_loop.data.feed`): a step, the last step of an interval (which
also returns its gradients and closes the interval), with
`steps_per_dispatch > 1` several steps in one call and the interval's last
steps in one call that also closes it; a stream's shorter last batch gets a
step of its own size. Set-up compiles the one the first dispatch needs; the
others the plan calls compile on a background thread while training starts;
the rest only when first called (`CompiledSteps`).
"""

import concurrent.futures
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from flax_loop.data.batch import Batch
from flax_loop.data.feed import LAST, MANY, MANY_LAST, ONE, SHORTER, DispatchPlan
from flax_loop.parallel import Placement
from flax_loop.step.lowering import lower_update
from flax_loop.step.packing import MAX_STATE_BYTES, LayoutChanged, Packing, on_packed
from flax_loop.step.state import TrainState, close_interval
from flax_loop.step.statistics import Update


def _compile(lowering: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
    return lowering().compile()


_POLL_SECONDS = 0.05


class _Compiling:
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


def _lower_variant(
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


def _with_sums(
    state: TrainState, shardings: TrainState | None, names: Any, placement: Placement
) -> tuple[TrainState, TrainState | None]:
    r"""The state and its shardings with a zero sum for each metric the loss reports."""
    zeros = {name: np.zeros((), np.float32) for name in names}
    state = state._replace(metric_sums=placement.replicate(zeros))
    if shardings is not None:
        shardings = shardings._replace(metric_sums={name: placement.replicated for name in names})
    return state, shardings


class CompiledSteps:
    r"""The update compiled in the variants a `DispatchPlan` calls.

    `programs` maps each variant's name (`flax_loop.data.feed`) to the program
    that runs it, `program(state, batch, key)`: `ONE` and `MANY` return
    `(state, loss)`, `LAST` and `MANY_LAST` (which close the interval)
    `(state, loss, grads, statistics)` (the loss a vector of every step's
    with several steps). The variants the plan calls are `needed`, the first
    dispatch's first: it is traced and compiled at set-up (a model's or
    loss's error is raised there); the other needed ones are traced and
    compiled on a background thread, so that training starts meanwhile (a
    variant called before it is ready waits for it, and raises its error);
    the rest (say, the single step when a checkpoint comes every step) only
    if a changed cadence calls them (`follow`). Nothing is compiled for a
    later batch, so a changed batch shape is an error, never a silent
    recompilation.

    Args:
        update: the per-device update (`flax_loop.step.statistics.counted`).
        placement: the devices.
        state: the initial state, placed.
        sample_batch: `sample_batch(n_steps)`, a batch as the steps take it
            (`n_steps` stacked for several), for the programs' shapes.
        key: the replicated key the steps take.
        plan: the dispatch plan.
        shardings: the state's shardings, or `None` when replicated.
        grads_like: maps a tree shaped as the parameters to one shaped as
            the step's gradients (`Objective.grads_like`); identity by default.
    """

    def __init__(
        self,
        update: Update,
        placement: Placement,
        state: TrainState,
        sample_batch: Callable[[int], Batch],
        key: jax.Array,
        plan: DispatchPlan,
        shardings: TrainState | None = None,
        grads_like: Callable[[Any], Any] | None = None,
    ) -> None:
        started = time.perf_counter()
        self.compile_seconds = 0.0
        r"""seconds the caller's thread spent compiling, or waiting for a
        compilation on the background thread: set-up's, then any since."""
        self.grads_like = grads_like or (lambda tree: tree)
        r"""maps a tree shaped as the parameters to one shaped as the gradients."""
        self.interrupted: Callable[[], bool] | None = None
        r"""asked while a program waits for its compilation: once true, the
        call raises `KeyboardInterrupt` instead, before running anything."""
        needed = plan.needed()
        first = needed[0]
        if shardings is not None:
            mode = "gspmd"
        else:
            mode = "shard_map" if placement.n_devices > 1 else "jit"
        replicated = placement.replicated
        # A replicated state travels packed: fewer arrays a call (flax_loop.step.packing).
        packing = None if shardings is not None else _packing_of(state)
        batch = sample_batch(1)
        stacked = sample_batch(plan.steps_per_dispatch) if plan.steps_per_dispatch > 1 else None
        closing = sample_batch(plan.closing_steps) if plan.closing_steps else None
        self._stacked = stacked

        def lower(name: str, state: Any, shardings: TrainState | None) -> Any:
            lower_with = functools.partial(
                lower_update,
                update,
                placement,
                mode=mode,
                shardings=shardings,
                packing=packing,
                grads_like=self.grads_like,
            )
            return _lower_variant(lower_with, name, state, key, plan, (batch, stacked, closing))

        def lower_first() -> Any:
            packed = state if packing is None else run_once(packing.pack, replicated, state)
            return packed, lower(first, packed, shardings)

        try:
            try:
                packed, program = lower_first()
            except NameError as error:
                # A model that names the batch axis (BatchNorm(axis_name="data")) on
                # one device: bind the axis with a one-device mesh.
                unbound = f"unbound axis name: {placement.batch_axis}"
                if mode != "jit" or unbound not in str(error):
                    raise
                mode = "shard_map"
                packed, program = lower_first()
        except LayoutChanged as changed:  # the loss reports metrics: carry their sums
            state, shardings = _with_sums(state, shardings, changed.state.metric_sums, placement)
            if packing is not None:
                packing = _packing_of(state)
            packed, program = lower_first()
        self.packing = packing
        r"""the layout the state travels in, or `None` (a sharded state)."""
        # the unpacked state's shapes and layout, for the programs below
        self._unpacked = jax.tree.map(_abstract, state)
        state = packed
        self.state = state
        r"""the state to start from (with the metric sums the loss needs)."""
        self._lower = functools.partial(
            lower_update,
            update,
            placement,
            key=key,
            mode=mode,
            shardings=shardings,
            packing=packing,
            grads_like=self.grads_like,
        )
        self._shorter: dict[Any, Callable[..., Any]] = {}
        state_sharding = replicated if shardings is None else shardings
        # The other variants are traced on the background thread, from the
        # state's shapes and layout (the state itself is donated meanwhile).
        abstract = jax.tree.map(_abstract, state)
        self._abstract = abstract
        names = [LAST, ONE] + ([MANY] if stacked is not None else [])
        names += [MANY_LAST] if plan.closing_steps else []
        later = {
            name: functools.partial(_compile, functools.partial(lower, name, abstract, shardings))
            for name in names
            if name != first
        }
        self.programs: dict[str, Any] = {SHORTER: self._shorter_step}
        r"""the program of each variant, by name (`flax_loop.data.feed`)."""
        # the closing groups compiled (or compiling), by size: a changed cadence
        # ends its intervals with a group of another size
        self._closing_groups: dict[int, Any] = {}
        self._close_interval: Callable[..., Any]
        self._copy: Callable[..., Any]
        self._background = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="flax_loop-compile"
        )
        # The other needed variants are traced and compiled once the first is,
        # while the first steps run (compiled beside it, they would only share
        # the cores with it). The interval's separate close is needed only when
        # an interval ends without its `last` step (a stop, the stream's end):
        # it is traced, lowered and compiled then (a small program).
        try:
            self.programs[first] = program.compile()
            for name, compile in later.items():
                if name in needed:
                    future = self._background.submit(compile)
                    self.programs[name] = _Compiling(
                        future, self.programs, name, lambda: self.interrupted, self._waited
                    )
                else:
                    self.programs[name] = _Compiling(
                        compile, self.programs, name, waited=self._waited
                    )
            if plan.closing_steps:
                self._closing_groups[plan.closing_steps] = self.programs[MANY_LAST]
            grads = self.grads_like(self._unpacked.model_params)
            closing_layout = (state_sharding, replicated)
            self._close_interval = _Compiling(
                lambda: _compile_close(packing, closing_layout, abstract, grads),
                waited=self._waited,
            )
            # every checkpoint copies the state
            self._copy = _Compiling(
                self._background.submit(functools.partial(self._compile_copy, placement)),
                waited=self._waited,
            )
        finally:
            self._background.shutdown(wait=False)  # the thread ends after the last one
        self.compile_seconds += time.perf_counter() - started

    @property
    def state_shapes(self) -> TrainState:
        r"""the state's shapes, dtypes and shardings, unpacked (`jax.ShapeDtypeStruct`)."""
        return self._unpacked

    def _waited(self, seconds: float) -> None:
        self.compile_seconds += seconds

    def follow(self, plan: DispatchPlan) -> None:
        r"""Makes `programs[MANY_LAST]` end the intervals of `plan` (a changed
        cadence): a closing group of its size, compiled when first called."""
        size = plan.closing_steps
        if not size:
            return
        program = self._closing_groups.get(size)
        if program is None:
            stacked = self._stacked
            assert stacked is not None, "closing groups come with several steps a dispatch"
            closing = jax.tree.map(
                lambda leaf: jax.ShapeDtypeStruct(
                    (size, *leaf.shape[1:]), leaf.dtype, sharding=getattr(leaf, "sharding", None)
                ),
                stacked,
            )
            lowering = functools.partial(
                self._lower, self._abstract, closing, n_steps=size, with_grads=True, closing=True
            )
            program = _Compiling(
                functools.partial(_compile, lowering), self.programs, MANY_LAST, waited=self._waited
            )
            self._closing_groups[size] = program
        self.programs[MANY_LAST] = program

    def _compile_copy(self, placement: Placement) -> Callable[..., Any]:
        packing = self.packing
        if packing is None:
            return lambda state: placement.copy(state.saved_arrays())

        def copy(packed: Any) -> dict[str, Any]:
            # a compiled program's outputs are buffers of its own (its input is
            # not donated), which the next step's donation leaves alone
            return packing.unpack(packed).saved_arrays()

        abstract = jax.tree.map(_abstract, self.state)
        # slices and copies: compiled as the initial state is, for a short compilation
        copying = jax.jit(copy, out_shardings=placement.replicated).lower(abstract)
        return copying.compile(run_once_options())

    def copier(self) -> Callable[[Any], dict[str, Any]]:
        r"""`copy(state)`: the saved state's arrays (`TrainState.saved_arrays`)
        as fresh arrays, which outlive the loop's donation of its own to the
        next step (a checkpoint's); compiled, once this returns."""
        if isinstance(self._copy, _Compiling):
            self._copy = self._copy.result()
        return self._copy

    def wait(self) -> None:
        r"""Waits until every variant is compiled (raising a compilation's error)."""
        for compiled in (*self.programs.values(), self._close_interval, self._copy):
            if isinstance(compiled, _Compiling):
                compiled.result()

    def _shorter_step(self, state: TrainState, batch: Batch, key: jax.Array) -> Any:
        r"""One step on a stream's shorter last batch, `-> (state, loss, grads,
        None)` (it does not close the interval), compiled for its size on
        first use (once per size)."""
        shapes = tuple(np.shape(leaf) for leaf in jax.tree.leaves(batch))
        compiled = self._shorter.get(shapes)
        if compiled is None:
            started = time.perf_counter()
            lowered = self._lower(state, batch, with_grads=True)
            compiled = self._shorter[shapes] = lowered.compile()
            self._waited(time.perf_counter() - started)
        return (*compiled(state, batch, key), None)

    def close_interval(self, state: TrainState, grads: Any) -> Any:
        r"""Closes an interval that ended without a closing variant (a stop,
        the stream's end, a shorter last batch): `-> (state with its
        interval sums reset, statistics)`, compiled when first needed."""
        return self._close_interval(state, grads)


def _compile_close(packing: Packing | None, shardings: Any, state: Any, grads: Any) -> Any:
    r"""The interval's separate close (`close_interval`) compiled for the
    state's layout (`state`, `grads`: their shapes), `shardings` those of its
    outputs."""
    close = jax.jit(on_packed(close_interval, packing), donate_argnums=0, out_shardings=shardings)
    return close.lower(state, grads).compile()


def _packing_of(state: TrainState) -> Packing | None:
    r"""The state's packing; `None` for a state of more than `MAX_STATE_BYTES`,
    or one with fewer than two leaves to pack."""
    if sum(leaf.nbytes for leaf in jax.tree.leaves(state)) > MAX_STATE_BYTES:
        return None
    packing = Packing(state)
    return packing if packing.n_packed >= 2 else None


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)


_LEVEL = "xla_backend_optimization_level"


def run_once(fn: Callable[..., Any], out_shardings: Any, *args: Any) -> Any:
    r"""`jax.jit(fn, out_shardings=out_shardings)(*args)` for a program run
    once (an initialization), compiled with `run_once_options()`."""
    lowered = jax.jit(fn, out_shardings=out_shardings).lower(*args)
    return lowered.compile(compiler_options=run_once_options())(*args)


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
