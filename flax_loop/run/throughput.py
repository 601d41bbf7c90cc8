r"""A run's throughput and where its time goes: the meters set up, and described.

Throughput: examples, tokens and FLOPs a second, and the fraction of the
devices' peak (MFU) a run reaches. The meters (`Throughput`,
`TimeBreakdown`) live where each interval closes (`flax_loop.run.interval`);
`meter` sets one up from the run's first batch and devices.

The step's FLOPs are XLA's count for the compiled step (its cost analysis,
read once); examples and tokens are counted on the host from the first
batch's shapes. Nothing here waits for the devices.

>>> rates_of = Throughput(examples_per_step=32, tokens_per_step=None, n_devices=2,
...                       peak_flops=1e9)
>>> rates_of.flops_per_step = 4e8
>>> rates = rates_of.measure(n_steps=10, seconds=2.0)
>>> rates["examples_per_second"], rates["flops_per_second_per_device"], rates["mfu"]
(160.0, 1000000000.0, 1.0)

Time (`TimeBreakdown`): compiling, waiting for data, the devices' steps,
and the caller's own code between checkpoints.

The loop's thread is always doing one of these, and the loop notes the
time at the edges between them (two clock reads a dispatch, no wait for
the devices added): from the checkpoint it hands out to the next one,

- `caller`: the caller's loop body (evaluation, writing, logging), until
  it asks for the next checkpoint, less the time the devices still
  finished the interval meanwhile (a checkpoint a `for` loop hands out
  before they are done, `flax_loop.run.arrival`: that time is `device`);
- `data`: waiting for the next batch (reading, checking, stacking and
  placing it, when no read-ahead thread has it ready);
- `compile`: compiling a step, or waiting for one compiling in the
  background;
- `device`: dispatching the steps and waiting for the devices to finish
  them (their results, the checkpoint's copy).

They add up to `wall`, the interval's wall time; `device / wall` is the
*goodput*. The devices run ahead of the loop's thread, so a device kept busy
by queued steps while the thread waits for a slow batch shows that wait as
`data`: the figures say what held the loop up.

>>> times = TimeBreakdown(setup=2.0, compile=1.5, handed_out=10.0)
>>> times.close(started=10.5, ended=14.0, data=0.25, device=3.25, compiled=0.25)
{'compile': 0.25, 'data': 0.25, 'device': 3.0, 'caller': 0.5, 'wall': 4.0}
>>> from flax_loop.checkpoint import goodput
>>> times.totals()["wall"], goodput(times.totals())
(6.0, 0.5)
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from flax_loop.data.batch import BatchTree
from flax_loop.data.feed import BatchFeed
from flax_loop.errors import ConfigError
from flax_loop.parallel import Placement
from flax_loop.run.interval import Throughput, TimeBreakdown

PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12),
    ("TPU v6e", 918e12),
)
r"""Dense bfloat16 peak FLOP/s of one device, by a part of its
`device_kind` (the first that matches): the vendors' published figures.
Set `loop.peak_flops` for a device not listed."""

PARTS = ("compile", "data", "device", "caller")
r"""The parts an interval's wall time is made of (`TimeBreakdown`)."""

TokenCount = Callable[[Any], int]
r"""`tokens(batch) -> int`; the tokens of one batch, from its shapes."""


def device_peak(device: Any) -> float | None:
    r"""The listed peak FLOP/s of a device (`PEAK_FLOPS`), or `None`.

    >>> import jax
    >>> device_peak(jax.devices("cpu")[0]) is None
    True
    """
    kind = str(getattr(device, "device_kind", ""))
    return next((peak for name, peak in PEAK_FLOPS if name in kind), None)


def step_flops(programs: Mapping[str, Any]) -> float | None:
    r"""The FLOPs of one step on one device, from XLA's cost analysis of a
    compiled single step (`one`, else `last`), else of several steps a
    dispatch (`many`: XLA counts the body of its scan, one step, once; else
    `many_last`, a scan of all but the interval's last step and that step
    alone: two steps, as a cadence equal to `steps_per_dispatch` compiles
    only it), or `None` while none is compiled or when the backend does not
    count them."""
    for name, steps in (("one", 1), ("last", 1), ("many", 1), ("many_last", 2)):
        analysis = getattr(programs.get(name), "cost_analysis", None)
        if analysis is None:
            continue
        try:
            costs = analysis()
        except Exception:  # a backend without cost analysis
            return None
        if isinstance(costs, (list, tuple)):
            costs = costs[0] if costs else None
        flops = costs.get("flops") if isinstance(costs, Mapping) else None
        return float(flops) / steps if flops and flops > 0 else None
    return None


def tokens_per_batch(tokens: TokenCount | None, batch: Any, first_input: Any) -> int | None:
    r"""The tokens of a batch: `tokens(batch)` when given, else the size of
    an integer input of shape (batch, length) (token ids), else `None`.

    Raises:
        ConfigError: if `tokens` fails or returns no whole number.
    """
    if tokens is None:
        is_ids = np.ndim(first_input) == 2 and np.issubdtype(
            np.dtype(first_input.dtype), np.integer
        )
        return int(np.size(first_input)) if is_ids else None
    return counted_in_batch(tokens, batch, "tokens", "batch[0].size")


def counted_in_batch(count_of: Callable[[Any], int], batch: Any, what: str, example: str) -> int:
    r"""`count_of(batch)`, the task's count of `what` in a batch (`tokens`,
    `examples`), checked.

    Raises:
        ConfigError: if it fails or returns no whole number.
    """
    try:
        count = count_of(batch)
    except Exception as error:
        raise ConfigError(
            f"{what}(batch) raised {type(error).__name__}: {error}. It gets the first "
            f"batch as the stream gave it and returns the {what} in it, e.g. "
            f"{what}=lambda batch: {example}."
        ) from None
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ConfigError(f"{what}(batch) must return a whole number of {what}; got {count!r}.")
    return int(count)


def done_line(trained: int, step: int, totals: dict[str, Any]) -> str:
    r"""The closing line of a run trained to its last step (`step`): the
    steps this process trained and where the time went.

    >>> line = done_line(600, 1000, {"setup": 1, "compile": 1, "data": 0, "device": 7,
    ...                              "caller": 1, "wall": 10})
    >>> line.split(": ")[0]
    '600 steps (to step 1,000) in 10.0 s'
    """
    to = "" if trained == step else f" (to step {step:,})"
    return f"{trained:,} steps{to} in {float(totals['wall']):.1f} s: {describe(totals)}."


def describe(breakdown: dict[str, Any]) -> str:
    r"""One line of where the time went, as shares of the wall time.

    >>> describe({"setup": 1, "compile": 1, "data": 0, "device": 7, "caller": 1, "wall": 10})
    'device 70%, setup 10%, compile 10%, your code 10%, data 0%'
    """
    wall = float(breakdown.get("wall", 0.0))
    if wall <= 0:
        return "no time measured"
    names = {"caller": "your code"}
    shares = sorted(
        ((part, float(value) / wall) for part, value in breakdown.items() if part != "wall"),
        key=lambda item: -item[1],
    )
    return ", ".join(f"{names.get(part, part)} {share:.0%}" for part, share in shares)


def meter(
    feed: BatchFeed,
    tree: BatchTree | None,
    placement: Placement,
    tokens: TokenCount | None,
    examples: TokenCount | None = None,
) -> Throughput:
    r"""A run's meter, from its feed's first batch (`tree`: its structure,
    for a `compute_loss` task) and its devices; `tokens` and `examples`
    the task's counts of a batch, if given (by default, token ids and the
    batch's leading size).

    Raises:
        ConfigError: for a `tokens` or `examples` that fails.
    """
    sample = feed.sample
    if tree is None:
        inputs, targets = sample
        one_each = len(inputs) == len(targets) == 1
        given = (inputs[0], targets[0]) if one_each else (inputs, targets)
        first_input = inputs[0] if inputs else None
    else:
        given = tree.unflatten(sample)
        first_input = jax.tree.leaves(sample)[0]
    processes = placement.n_shards // max(placement.n_local_shards, 1)  # every process feeds
    counted = tokens_per_batch(tokens, given, first_input)
    n_examples = (
        feed.spec.batch_size
        if examples is None
        else counted_in_batch(examples, given, "examples", 'len(batch["label"])')
    )
    return Throughput(
        examples_per_step=n_examples * processes,
        tokens_per_step=None if counted is None else counted * processes,
        n_devices=placement.n_devices,
        peak_flops=device_peak(placement.devices[0]),
        flops_of=step_flops,
    )


__all__ = [
    "PARTS",
    "PEAK_FLOPS",
    "Throughput",
    "TimeBreakdown",
    "counted_in_batch",
    "describe",
    "device_peak",
    "done_line",
    "meter",
    "step_flops",
    "tokens_per_batch",
]
