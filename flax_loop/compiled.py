r"""The update compiled in the variants a loop dispatches, and when each compiles.

A loop dispatches a step, the last step of an interval (which also returns
its gradients and closes the interval), and, with `steps_per_dispatch > 1`,
several steps in one call, and the interval's last steps in one call that
also closes it; a stream's shorter last batch gets a step of its own size.
Set-up compiles the one the first dispatch needs; the others the cadence
calls compile on a background thread while training starts; the rest only
when first called (`CompiledSteps`).
"""

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from flax_loop.batch import Batch
from flax_loop.initial import run_once, run_once_options
from flax_loop.packing import MAX_STATE_BYTES, LayoutChanged, Packing, on_packed
from flax_loop.parallel import DATA_AXIS, Placement, to_host
from flax_loop.state import IntervalResult, IntervalStatistics, TrainState, close_interval
from flax_loop.step import Update, lower_update


def _compile(lowering: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
    return lowering().compile()


class _Compiling:
    r"""A variant compiling on the background thread (`source` its future), or
    compiled when first called (`source` compiles it): called, it waits for
    the executable, puts it in its owner's attribute (later calls go straight
    to it) and runs it."""

    def __init__(
        self, owner: Any, name: str, source: concurrent.futures.Future | Callable[[], Any]
    ) -> None:
        self._owner, self._name, self._source = owner, name, source

    def result(self) -> Callable[..., Any]:
        source = self._source
        compiled = source.result() if isinstance(source, concurrent.futures.Future) else source()
        setattr(self._owner, self._name, compiled)
        return compiled

    def __call__(self, *args: Any) -> Any:
        return self.result()(*args)


class CompiledSteps:
    r"""The update compiled in the variants a loop dispatches.

    A step (`one`); the last step of an interval, which also returns its
    gradients and closes the interval (`last`); with `steps_per_dispatch >
    1`, that many steps in one call (`many`), and the steps that end an
    interval in one call that closes it as `last` does (`many_last`). The
    variants the loop's cadence calls are `needed`, the first dispatch's
    first: it is traced and compiled at set-up (a model's or loss's error is
    raised there); the other needed ones are traced and compiled on a
    background thread, so that training starts meanwhile (a variant called
    before it is ready waits for it, and raises its error); the rest (say,
    the single step when a checkpoint comes every step) only if a changed
    cadence calls them. Nothing is compiled for a later batch, so a changed
    batch shape is an error, never a silent recompilation.
    """

    def __init__(
        self,
        update: Update,
        placement: Placement,
        state: TrainState,
        batch: Batch,
        stacked: Batch | None,
        key: jax.Array,
        steps_per_dispatch: int,
        shardings: TrainState | None = None,
        needed: Sequence[str] = ("one", "last"),
        closing: Batch | None = None,
    ) -> None:
        first = needed[0]
        if shardings is not None:
            mode = "gspmd"
        else:
            mode = "shard_map" if placement.n_devices > 1 else "jit"
        replicated = placement.replicated
        # A replicated state travels packed: fewer arrays a call (flax_loop.packing).
        packing = None if shardings is not None else _packing_of(state)

        def lower(name: str, state: Any, shardings: TrainState | None) -> Any:
            lower_with = functools.partial(
                lower_update, update, placement, mode=mode, shardings=shardings, packing=packing
            )
            if name == "many":
                assert stacked is not None
                return lower_with(state, stacked, key, n_steps=steps_per_dispatch)
            if name == "many_last":
                assert closing is not None
                n_steps = jax.tree.leaves(closing)[0].shape[0]
                return lower_with(
                    state, closing, key, n_steps=n_steps, with_grads=True, closing=True
                )
            last = name == "last"  # it closes the interval too
            return lower_with(state, batch, key, with_grads=last, closing=last)

        def lower_first() -> Any:
            packed = state if packing is None else run_once(packing.pack, replicated, state)
            return packed, lower(first, packed, shardings)

        try:
            try:
                packed, program = lower_first()
            except NameError as error:
                # A model that names the data axis (BatchNorm(axis_name=DATA_AXIS)) on
                # one device: bind the axis with a one-device mesh.
                if mode != "jit" or f"unbound axis name: {DATA_AXIS}" not in str(error):
                    raise
                mode = "shard_map"
                packed, program = lower_first()
        except LayoutChanged as changed:  # the loss reports metrics: carry their sums
            names = changed.state.metric_sums
            zeros = {name: np.zeros((), np.float32) for name in names}
            state = state._replace(metric_sums=placement.replicate(zeros))
            if shardings is not None:
                shardings = shardings._replace(
                    metric_sums={name: placement.replicated for name in names}
                )
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
            with_grads=True,
            mode=mode,
            shardings=shardings,
            packing=packing,
        )
        self._shorter: dict[Any, Callable[..., Any]] = {}
        state_sharding = replicated if shardings is None else shardings
        close = jax.jit(
            on_packed(close_interval, packing),
            donate_argnums=0,
            out_shardings=(state_sharding, replicated),
        ).lower(state, self._unpacked.model_params)
        # The other variants are traced on the background thread, from the
        # state's shapes and layout (the state itself is donated meanwhile).
        abstract = jax.tree.map(_abstract, state)
        names = ["last", "one"] + (["many"] if stacked is not None else [])
        names += ["many_last"] if closing is not None else []
        later = {
            name: functools.partial(_compile, functools.partial(lower, name, abstract, shardings))
            for name in names
            if name != first
        }
        self.one: Callable[..., Any]
        self.last: Callable[..., Any]
        self.many: Callable[..., Any] | None = None
        self.many_last: Callable[..., Any] | None = None
        self._close_interval: Callable[..., Any]
        self._copy: Callable[..., Any]
        self._background = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="flax_loop-compile"
        )
        # The other needed variants are traced and compiled once the first is,
        # while the first steps run (compiled beside it, they would only share
        # the cores with it). The interval's separate close is needed only when
        # an interval ends without its `last` step (a stop, the stream's end):
        # it compiles then (a small program).
        try:
            setattr(self, first, program.compile())
            for name, compile in later.items():
                if name in needed:
                    self._compile_later(name, compile)
                else:
                    setattr(self, name, _Compiling(self, name, compile))
            self._close_interval = _Compiling(self, "_close_interval", close.compile)
            # every checkpoint copies the state
            self._compile_later("_copy", functools.partial(self._compile_copy, placement))
        finally:
            self._background.shutdown(wait=False)  # the thread ends after the last one

    def _compile_copy(self, placement: Placement) -> Callable[..., Any]:
        packing = self.packing
        if packing is None:
            return lambda state: placement.copy(_kept(state))

        def copy(packed: Any) -> tuple[Any, Any, Any, Any]:
            # a compiled program's outputs are buffers of its own (its input is
            # not donated), which the next step's donation leaves alone
            return _kept(packing.unpack(packed))

        abstract = jax.tree.map(_abstract, self.state)
        # slices and copies: compiled as the initial state is, for a short compilation
        copying = jax.jit(copy, out_shardings=placement.replicated).lower(abstract)
        return copying.compile(run_once_options())

    def copy(self, state: Any) -> tuple[Any, Any, Any, Any]:
        r"""`(model_params, model_state, optimizer_state, ema_params)` of the
        state as fresh arrays, which outlive the loop's donation of its own to
        the next step (a checkpoint's)."""
        return self._copy(state)

    def _compile_later(self, name: str, compile: Callable[[], Any]) -> None:
        future = self._background.submit(compile)
        setattr(self, name, _Compiling(self, name, future))

    def wait(self) -> None:
        r"""Waits until every variant is compiled (raising a compilation's error)."""
        for name in ("one", "last", "many", "many_last", "_close_interval", "_copy"):
            variant = getattr(self, name)
            if isinstance(variant, _Compiling):
                variant.result()

    def shorter(self, state: TrainState, batch: Batch, key: jax.Array) -> Any:
        r"""One step on a stream's shorter last batch, `-> (state, loss, grads)`,
        compiled for its size on first use (once per size)."""
        shapes = tuple(np.shape(leaf) for leaf in jax.tree.leaves(batch))
        compiled = self._shorter.get(shapes)
        if compiled is None:
            compiled = self._shorter[shapes] = self._lower(state, batch).compile()
        return compiled(state, batch, key)

    def finish_interval(
        self,
        state: TrainState,
        grads: Any,
        loss: jax.Array,
        n_steps: int,
        statistics: IntervalStatistics | None = None,
    ) -> tuple[TrainState, IntervalResult]:
        r"""The interval's statistics on the host (the host's one wait for the
        devices in an interval), and the state with its interval sums reset.

        `statistics` are those the `last` step returned (it closed the
        interval); without them (an interval ended by a stop request or the
        stream's end) the interval is closed here."""
        if statistics is None:
            state, statistics = self._close_interval(state, grads)
        loss, (counters, loss_sum, metric_sums, finite) = to_host((loss, statistics))
        _, n_nonfinite, first_nonfinite = (int(count) for count in counters)
        n_finite = n_steps - n_nonfinite

        def mean(total: Any) -> float:
            return float(total) / n_finite if n_finite else float("nan")

        metrics = {name: mean(total) for name, total in metric_sums.items()}
        return state, IntervalResult(
            float(np.reshape(loss, -1)[-1]),
            mean(loss_sum),
            n_nonfinite,
            first_nonfinite,
            bool(finite),
            metrics,
        )


def closing_steps(every: int, steps_per_dispatch: int) -> int:
    r"""The steps of the dispatch that ends an interval of `every` steps (the
    ones before it dispatch `steps_per_dispatch` steps each), if several;
    else 0 (a single closing step).

    >>> closing_steps(100, 32), closing_steps(96, 32), closing_steps(97, 32), closing_steps(3, 4)
    (4, 32, 0, 3)
    """
    if steps_per_dispatch == 1:
        return 0
    tail = every - steps_per_dispatch * ((every - 1) // steps_per_dispatch)
    return tail if tail > 1 else 0


def needed_variants(every: int, steps_per_dispatch: int) -> list[str]:
    r"""The variants a cadence of `every` steps calls, the first dispatch's first.

    A checkpoint every step calls only the interval's closing step. With
    several steps a dispatch, an interval is groups and a closing group (or
    the closing step alone); the closing step also ends an interval cut short
    by a stop; single steps end other ones (a resumed or shorter run's) and
    compile when first called.

    >>> needed_variants(1, 1), needed_variants(10, 1)
    (['last'], ['one', 'last'])
    >>> needed_variants(100, 32), needed_variants(97, 32), needed_variants(32, 32)
    (['many', 'many_last', 'last'], ['many', 'last'], ['many_last', 'last'])
    """
    if steps_per_dispatch == 1:
        return ["last"] if every == 1 else ["one", "last"]
    needed = ["many"] if every > steps_per_dispatch else []
    needed += ["many_last"] if closing_steps(every, steps_per_dispatch) else []
    return needed + ["last"]


def _packing_of(state: TrainState) -> Packing | None:
    r"""The state's packing; `None` for a state of more than `MAX_STATE_BYTES`,
    or one with fewer than two leaves to pack."""
    if sum(leaf.nbytes for leaf in jax.tree.leaves(state)) > MAX_STATE_BYTES:
        return None
    packing = Packing(state)
    return packing if packing.n_packed >= 2 else None


def _kept(state: TrainState) -> tuple[Any, Any, Any, Any]:
    r"""What a checkpoint keeps of the state."""
    return state.model_params, state.model_state, state.optimizer_state, state.ema_params


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
