r"""Will it fit: the bytes each device holds while training, before the first step.

`TrainLoop.memory_plan()` adds up, per device, the bytes of the state's
shards (parameters and the model's other collections, the optimizer's
state, the moving average), a dispatch's batch, the compiled step's
temporaries (XLA's memory analysis of the compiled programs) and the copy
of the saved state a checkpoint hands out. Arrays laid out over the
devices count their shard; replicated ones count whole on each device.

>>> import jax, numpy as np
>>> state = {"params": {"w": jax.ShapeDtypeStruct((1024, 256), np.float32)}}
>>> per_device_bytes(state["params"], jax.devices()[:1])
[1048576]
>>> format_plan({"params": 1048576, "optimizer_state": 2097152, "batch": 4096,
...              "checkpoint": 3145728, "total": 6295552})
'6.0 MiB a device: params 1.0 MiB, optimizer state 2.0 MiB, batch 4.0 KiB, checkpoint copy 3.0 MiB'
"""

import math
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from flax_loop.errors import ConfigError
from flax_loop.log import format_bytes

STATE_PARTS = ("params", "model_state", "optimizer_state")
r"""The parts the state's fields every step carries count under; a field a
step declares counts under its own name (`ema_params`)."""

RUN_PARTS = ("batch", "temporaries", "checkpoint")
r"""The parts of a device's memory besides the state's fields; `total` is
the sum of every part."""

_NAMES = {"optimizer_state": "optimizer state", "model_state": "model state"}
_NAMES["checkpoint"] = "checkpoint copy"


def _part(field: str) -> str:
    r"""The part a carried field counts under: `model_params` as `params`,
    a field of the step's own under its name."""
    return "params" if field == "model_params" else field


def _shard_bytes(leaf: Any) -> tuple[int, Iterable[Any]]:
    r"""A leaf's bytes on each device that holds it, and those devices."""
    itemsize = leaf.dtype.itemsize  # a typed key's too (np.dtype has none)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return math.prod(leaf.shape) * itemsize, ()
    shape = sharding.shard_shape(leaf.shape)
    return math.prod(shape) * itemsize, sharding.device_set


def per_device_bytes(tree: Any, devices: Sequence[Any]) -> list[int]:
    r"""The bytes of a tree's arrays on each of `devices` (an array without
    a sharding counts whole on every device)."""
    totals = dict.fromkeys(devices, 0)
    for leaf in jax.tree.leaves(tree):
        if not hasattr(leaf, "shape"):
            continue
        nbytes, holders = _shard_bytes(leaf)
        for device in holders or devices:
            if device in totals:
                totals[device] += nbytes
    return [totals[device] for device in devices]


def temporaries(programs: Iterable[Any]) -> int:
    r"""The largest temporary buffer size of the compiled programs (XLA's
    memory analysis, per device); 0 where the backend does not say."""
    return max((_temporary_bytes(program) for program in programs), default=0)


_analysed: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _temporary_bytes(program: Any) -> int:
    r"""A compiled program's temporary bytes, asked of XLA once a program
    (a re-run's set-up finds its programs in the cache: 2 ms saved)."""
    try:
        return _analysed[program]
    except (KeyError, TypeError):  # not asked yet, or a program without weak references
        pass
    analysis = getattr(program, "memory_analysis", None)
    try:
        stats = analysis() if analysis is not None else None
    except Exception:  # a backend without the analysis
        stats = None
    found = 0 if stats is None else int(getattr(stats, "temp_size_in_bytes", 0) or 0)
    try:
        _analysed[program] = found
    except TypeError:
        pass
    return found


def plan(state: Any, batch: Any, programs: Iterable[Any], devices: Sequence[Any]) -> dict[str, Any]:
    r"""The plan: one dict of bytes (a part each and `total`) when every
    device holds the same, else a dict of them by device.

    Args:
        state: the step's carried fields by name, arrays (or
            `jax.ShapeDtypeStruct` with their shardings): `model_params`,
            `model_state`, `optimizer_state` (parts `params`, `model_state`,
            `optimizer_state`), and any the step declares (a part of its
            name each, `ema_params`). An absent field (`None`) counts 0.
        batch: one dispatch's batch, laid out as the step takes it.
        programs: the compiled step programs.
        devices: the devices training runs on.

    A checkpoint's copy of the saved state is laid out as the state is, so
    it counts the state's bytes again (one checkpoint held at a time).
    """
    held = {_part(name): per_device_bytes(tree, devices) for name, tree in state.items()}
    ordered = [*STATE_PARTS, *sorted(set(held) - set(STATE_PARTS))]
    parts = {part: held.get(part, [0] * len(devices)) for part in ordered}
    parts["batch"] = per_device_bytes(batch, devices)
    parts["temporaries"] = [temporaries(programs)] * len(devices)
    parts["checkpoint"] = [
        sum(parts[part][index] for part in ordered) for index in range(len(devices))
    ]
    by_device = []
    for index in range(len(devices)):
        figures = {part: values[index] for part, values in parts.items()}
        figures["total"] = sum(figures.values())
        by_device.append(figures)
    if all(figures == by_device[0] for figures in by_device):
        return by_device[0]
    return {str(device): figures for device, figures in zip(devices, by_device)}


def plan_of(steps: Any, feed: Any, steps_per_dispatch: int, placement: Any) -> dict[str, Any]:
    r"""The `plan` of a set-up run: its `CompiledSteps`, `BatchFeed` and
    `Placement`."""
    return plan(
        steps.state_shapes.fields,
        dispatch_batch(feed.sample, steps_per_dispatch, placement),
        steps.programs.values(),
        placement.devices,
    )


def dispatch_batch(sample: Any, group: int, placement: Any) -> Any:
    r"""The shapes of one dispatch's batch (`group` stacked steps of
    `sample`, the first batch) laid out as the steps take it."""
    shapes = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(
            (group, *np.shape(leaf)) if group > 1 else np.shape(leaf), np.asarray(leaf).dtype
        ),
        sample,
    )
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        shapes,
        placement.batch_shardings(shapes, stacked=group > 1),
    )


def fullest(memory_plan: dict[str, Any]) -> dict[str, Any]:
    r"""The plan of the device that holds the most (the plan itself when all are alike)."""
    if "total" in memory_plan:
        return memory_plan
    return max(memory_plan.values(), key=lambda figures: figures["total"])


def device_limit(device: Any) -> int | None:
    r"""The bytes a device may allocate (`memory_stats()["bytes_limit"]` on
    GPUs and TPUs), or `None` where it does not say (CPUs)."""
    try:
        stats = device.memory_stats()
    except Exception:
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def check_fits(memory_plan: dict[str, Any], devices: Sequence[Any], fsdp: bool) -> None:
    r"""Raises a `ConfigError` when a device's plan exceeds its limit.

    Raises:
        ConfigError: naming the device, the figures and the remedies.
    """
    plans = [memory_plan] * len(devices) if "total" in memory_plan else list(memory_plan.values())
    for device, figures in zip(devices, plans):
        limit = device_limit(device)
        if limit is None or figures["total"] <= limit:
            continue
        remedies = ["a smaller batch", "steps_per_dispatch=1"]
        if not fsdp:
            remedies.insert(0, 'sharding="fsdp" (each device holds a share of the state)')
        raise ConfigError(
            f"Training would need {format_bytes(figures['total'])} on {device}, which "
            f"has {format_bytes(limit)}: {format_plan(figures).partition(': ')[2]}. "
            f"Try {', '.join(remedies)}, or more devices."
        )


def format_plan(figures: dict[str, Any]) -> str:
    r"""One device's plan in a line (parts of 0 bytes left out)."""
    shown = ", ".join(
        f"{_NAMES.get(part, part.replace('_', ' '))} {format_bytes(value)}"
        for part, value in figures.items()
        if part != "total" and value
    )
    return f"{format_bytes(figures['total'])} a device: {shown}"


def count_parameters(params: Any) -> tuple[int, int]:
    r"""The number of scalars in a pytree of arrays and their total bytes.

    >>> count_parameters({"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)})
    (8, 32)
    """
    leaves = jax.tree.leaves(params)
    return (
        sum(int(leaf.size) for leaf in leaves),
        sum(int(leaf.size) * leaf.dtype.itemsize for leaf in leaves),
    )


def describe_model(params: Any, n_devices: int, setup_seconds: float, trained: Any = None) -> str:
    r"""One line on the model's size and the loop's set-up time; with
    `trained` (the parameters that train, frozen ones `None`) how many train.

    >>> describe_model({"w": np.zeros((256, 4), np.float32)}, 4, 1.5)
    '1,024 parameters (4.0 KiB) on 4 devices; set-up 1.50 s'
    >>> describe_model({"w": np.zeros(8), "b": np.zeros(2)}, 1, 0.5, {"w": None, "b": np.zeros(2)})
    '10 parameters (80 B), 2 of 10 train, on 1 device; set-up 0.50 s'
    """
    n_params, n_bytes = count_parameters(params)
    devices = "1 device" if n_devices == 1 else f"{n_devices} devices"
    training = ""
    if trained is not None:
        n_trained, _ = count_parameters(trained)
        if n_trained != n_params:
            training = f", {n_trained:,} of {n_params:,} train,"
    return (
        f"{n_params:,} parameters ({format_bytes(n_bytes)}){training} "
        f"on {devices}; set-up {setup_seconds:.2f} s"
    )
