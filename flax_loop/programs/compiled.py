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
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import numpy as np

from flax_loop.data.batch import Batch
from flax_loop.data.feed import LAST, MANY, MANY_LAST, ONE, SHORTER, DispatchPlan
from flax_loop.parallel import Placement
from flax_loop.programs import cache
from flax_loop.programs.cache import identity, signature
from flax_loop.programs.lowering import lower_update
from flax_loop.programs.once import abstract
from flax_loop.programs.packing import Packing, packing_of
from flax_loop.programs.state import TrainState
from flax_loop.programs.statistics import Update
from flax_loop.programs.variants import (
    Compiling,
    Variants,
    compile_close,
    compile_copy,
    with_fields,
)


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
        update: the update of the whole batch (`flax_loop.programs.statistics.counted`).
        placement, state: the devices; the initial state, placed.
        sample_batch: `sample_batch(n_steps)`, a batch as the steps take it
            (`n_steps` stacked for several), for the programs' shapes.
        key, plan: the replicated key the steps take; the dispatch plan.
        shardings: the state's shardings, or `None` when replicated.
        grads_like: maps a tree shaped as the parameters to one shaped as
            the step's gradients (`Objective.grads_like`); identity by default.
        interrupted: asked while a program waits for its compilation (once
            true, the call raises `KeyboardInterrupt`), or `None`.
        defer: compile each program when first called (nothing left to
            train; the first variant is still traced, for its errors).
        program_key: what determines the programs but their arguments'
            shapes (`flax_loop.programs.cache`), or `None` (compile all anew).
        per_device: builds the same step written per device, run instead
            when the update names the batch axis (`mode`), or `None`.
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
        interrupted: Callable[[], bool] | None = None,
        defer: bool = False,
        program_key: Hashable | None = None,
        per_device: Callable[[], Update] | None = None,
    ) -> None:
        started = time.perf_counter()
        self.compile_seconds = 0.0
        r"""seconds the caller's thread spent compiling, or waiting for a
        compilation on the background thread: set-up's, then any since."""
        self.grads_like = grads_like or (lambda tree: tree)
        r"""maps a tree shaped as the parameters to one shaped as the gradients."""
        self.interrupted = interrupted
        r"""asked while a program waits for its compilation: once true, the
        call raises `KeyboardInterrupt` instead, before running anything."""
        needed = plan.needed()
        first = needed[0]
        # A replicated state travels packed: fewer arrays a call (flax_loop.programs.packing).
        packing = None if shardings is not None else packing_of(state)
        batch = sample_batch(1)
        stacked = sample_batch(plan.steps_per_dispatch) if plan.steps_per_dispatch > 1 else None
        closing = sample_batch(plan.closing_steps) if plan.closing_steps else None
        self._stacked = stacked
        variants = Variants(
            update, placement, key, plan, (batch, stacked, closing), self.grads_like,
            program_key, per_device,
        )  # fmt: skip
        self._variants = variants
        packed, program, state, shardings, packing, mode = variants.first(
            first, state, shardings, packing
        )
        self.packing = packing
        r"""the layout the state travels in, or `None` (a sharded state)."""
        self.mode = mode  # (`flax_loop.programs.lowering`): how the programs run
        # the unpacked state's shapes and layout, for the programs below
        self._unpacked = variants.unpacked_shapes
        self.state = packed
        r"""the state to start from (with the metric sums the loss needs)."""
        self._lower = functools.partial(
            lower_update, variants.update, placement, key=key, mode=mode, shardings=shardings,
            packing=packing, grads_like=self.grads_like,
        )  # fmt: skip
        self._shorter: dict[Any, Callable[..., Any]] = {}
        # The other variants are traced on the background thread, from the
        # state's shapes and layout (the state itself is donated meanwhile).
        self._abstract = jax.tree.map(abstract, packed)
        names = [LAST, ONE] + ([MANY] if stacked is not None else [])
        names += [MANY_LAST] if plan.closing_steps else []
        later = {
            name: functools.partial(
                variants.compiled, name, self._abstract, shardings, mode, packing
            )
            for name in names
            if name != first
        }
        self._shardings = shardings
        self.programs: dict[str, Any] = {SHORTER: self._shorter_step}
        r"""the program of each variant, by name (`flax_loop.data.feed`)."""
        # the closing groups compiled (or compiling), by size: a changed cadence
        # ends its intervals with a group of another size
        self._closing_groups: dict[int, Any] = {}
        self._close_interval: Callable[..., Any]
        self._copy: Callable[..., Any]
        if defer:
            needed = []  # every program compiles when first called
        self._schedule(first, program, needed, later, plan, placement, shardings, defer)
        self.compile_seconds += time.perf_counter() - started

    def _schedule(
        self,
        first: str,
        program: Callable[[], Any],
        needed: list[str],
        later: Mapping[str, Callable[[], Any]],
        plan: DispatchPlan,
        placement: Placement,
        shardings: TrainState | None,
        defer: bool = False,
    ) -> None:
        r"""Compiles the first variant here (when first called, with
        `defer`), and schedules the rest: the other
        needed ones on the background thread (while the first steps run:
        compiled beside it, they would only share the cores with it), the
        others, and the interval's separate close (needed only when an
        interval ends without its `last` step: a stop, the stream's end), when
        first called; the checkpoint's copier on the background thread."""
        background = _Background(self._waited)
        try:
            if defer:
                self.programs[first] = Compiling(program, self.programs, first, waited=self._waited)
            else:
                self.programs[first] = program()
            for name, compile in later.items():
                if name in needed:
                    self.programs[name] = background.program(
                        compile, self.programs, name, lambda: self.interrupted
                    )
                else:
                    self.programs[name] = Compiling(
                        compile, self.programs, name, waited=self._waited
                    )
            if plan.closing_steps:
                self._closing_groups[plan.closing_steps] = self.programs[MANY_LAST]
            replicated = placement.replicated
            layout = (replicated if shardings is None else shardings, replicated)
            params = self._unpacked.model_params
            close = _close(
                self._variants, self.grads_like, params, self.packing, self._abstract, layout
            )
            self._close_interval = Compiling(close, waited=self._waited)
            # every checkpoint copies the state
            copy = functools.partial(self._compile_copy, placement)
            self._copy = Compiling(copy, waited=self._waited) if defer else background.program(copy)
        finally:
            background.shutdown()

    @property
    def state_shapes(self) -> TrainState:
        r"""the state's shapes, dtypes and shardings, unpacked (`jax.ShapeDtypeStruct`)."""
        return self._unpacked

    def status(self) -> dict[str, str]:
        r"""Where each program stands: `"compiled"`, `"compiling"` (on the
        background thread) or `"on first call"`; the variants by name (but
        `SHORTER`, compiled for each size it meets), `"close"` (the
        interval's separate close) and `"copy"` (the checkpoint's copier)."""
        programs = {name: program for name, program in self.programs.items() if name != SHORTER}
        programs.update(close=self._close_interval, copy=self._copy)
        return {
            name: program.status if isinstance(program, Compiling) else "compiled"
            for name, program in programs.items()
        }

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
            assert self._stacked is not None, "closing groups come with several steps a dispatch"
            compile = self._variants.closing_group(
                size, self._lower, self._abstract, self._shardings, self._stacked
            )
            program = Compiling(compile, self.programs, MANY_LAST, waited=self._waited)
            self._closing_groups[size] = program
        self.programs[MANY_LAST] = program

    def _compile_copy(self, placement: Placement) -> Callable[..., Any]:
        key = self._variants.cache_key("copy", self._variants.signature_of(self._abstract))
        return compile_copy(self.packing, placement, self._abstract, key)

    def copier(self) -> Callable[[Any], dict[str, Any]]:
        r"""`copy(state)`: the saved state's arrays (`TrainState.saved_arrays`)
        as fresh arrays, which outlive the loop's donation of its own to the
        next step (a checkpoint's); compiled, once this returns."""
        if isinstance(self._copy, Compiling):
            self._copy = self._copy.result()
        return self._copy

    def with_fields(self, state: Any, fields: dict[str, Any]) -> Any:
        r"""`state` (as the steps take it: packed, or laid out) holding
        `fields` (the step's fields, of the state's structure, shapes and
        dtypes) instead of its own, its counters and sums kept (the steps are
        not compiled again)."""
        key = self._variants.cache_key("with fields", self._variants.signature_of(self._abstract))
        return with_fields(self.packing, self._unpacked, self._abstract, key)(state, fields)

    def wait(self) -> None:
        r"""Waits until every variant is compiled (raising a compilation's error)."""
        for compiled in (*self.programs.values(), self._close_interval, self._copy):
            if isinstance(compiled, Compiling):
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


def _close(
    variants: Variants,
    grads_like: Callable[[Any], Any],
    params: Any,
    packing: Packing | None,
    shapes: Any,
    layout: Any,
) -> Callable[[], Any]:
    r"""The interval's separate close (`compile_close`), keyed when first
    called: only an interval a stop or the data's end cuts short needs it."""

    def close() -> Any:
        grads = grads_like(params)
        key = variants.cache_key(
            "close", variants.signature_of(shapes), signature(grads), identity(layout)
        )
        return cache.compiled(key, lambda: compile_close(packing, layout, shapes, grads))

    return close


class _Background:
    r"""Where set-up's later programs come from: the process's cache (a
    re-run's, on the caller's thread), or the one compiling thread, started
    when a program is not there (`waited` counts the seconds a call waits)."""

    def __init__(self, waited: Callable[[float], None]) -> None:
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._waited = waited

    def program(
        self,
        compile: Callable[[], Any],
        programs: dict[str, Any] | None = None,
        name: str = "",
        interrupted: Callable[[], Callable[[], bool] | None] = lambda: None,
    ) -> Any:
        r"""`compile()`'s program if the cache has it, else a `Compiling` of
        it on the thread (`programs`, `name`, `interrupted`: `Compiling`'s)."""
        ready = cache.if_compiled(compile)
        if ready is not None:
            return ready
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="flax_loop-compile"
            )
        future = self._thread.submit(compile)
        return Compiling(future, programs, name, interrupted, self._waited)

    def shutdown(self) -> None:
        r"""The thread ends after its last program."""
        if self._thread is not None:
            self._thread.shutdown(wait=False)
