r"""The device mesh: replicated state, sharded batches, one host or many.

Everything the user receives is a global `jax.Array` without a device axis:
replicated state is laid out with `PartitionSpec()`, batches are split along
their first axis over the mesh's batch axis (`PartitionSpec("data")` by
default).
"""

from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from flax_loop.errors import ConfigError

DATA_AXIS = "data"
r"""The default name of the mesh axis the batch is split along
(`TrainLoop(batch_axis=...)` names another)."""

# On the CPU backend a queue of steps that run a cross-device collective aborts
# the process after 40 s ("Expected 4 threads to join the rendezvous"): the
# devices share 2 cores and starve each other's rendezvous. Waiting for step
# k - 2 before dispatching step k avoids it at no measured cost
# (benchmarks/loop_overhead.py bounds its hand-written baseline the same way).
CPU_COLLECTIVE_DISPATCH_DEPTH = 2
# Elsewhere the bound only keeps queued batches from piling up in memory.
DEFAULT_DISPATCH_DEPTH = 16


class Placement:
    r"""Where a loop's arrays live: a mesh over its devices (1-D by default),
    the batch split along its `batch_axis`.

    >>> placement = Placement(jax.devices())
    >>> state = placement.replicate({"w": np.ones(3)})     # same value on every device
    >>> batch = placement.shard_batch(np.zeros((8, 3)))    # first axis split across them
    >>> len(batch.addressable_shards) == placement.n_devices
    True
    """

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        mesh: Mesh | None = None,
        batch_axis: str = DATA_AXIS,
    ) -> None:
        if not isinstance(batch_axis, str) or not batch_axis:
            raise ConfigError(
                f"batch_axis must be the name of a mesh axis, such as 'data' or 'batch'; "
                f"got {batch_axis!r}."
            )
        self.batch_axis = batch_axis
        r"""the mesh axis the batch is split along (and gradients averaged over)."""
        if mesh is not None:
            if devices is not None:
                raise ConfigError("pass devices or mesh, not both: a mesh names its devices.")
            if not isinstance(mesh, Mesh) or batch_axis not in mesh.shape:
                axes = tuple(mesh.axis_names) if isinstance(mesh, Mesh) else None
                raise ConfigError(
                    f"mesh must be a jax.sharding.Mesh with a {batch_axis!r} axis (the batch "
                    f"is split along it; batch_axis names it), e.g. jax.make_mesh((2, 2), "
                    f"({batch_axis!r}, 'model')); got {mesh!r}"
                    + (f" (axes {axes}): pass batch_axis=<one of them>." if axes else ".")
                )
            devices = list(mesh.devices.flat)
            # XLA places the collectives (GSPMD): axes of the Explicit type
            # (jax.make_mesh's default) would make every sharded op spell out
            # its output's layout.
            mesh = Mesh(
                mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim
            )
        if devices is None:
            devices = jax.devices()
        devices = list(devices)
        if not devices:
            raise ConfigError(
                "devices is empty; pass None to use every device, or a "
                "non-empty list such as jax.devices()[:2]."
            )
        for device in devices:
            if not isinstance(device, jax.Device):
                raise ConfigError(
                    f"devices must hold jax.Device objects (from jax.devices()); "
                    f"got {device!r} of type {type(device).__name__}."
                )
        if len(set(devices)) != len(devices):
            raise ConfigError(f"devices lists a device twice: {devices}.")
        self.devices = devices
        self.mesh = mesh if mesh is not None else Mesh(np.array(devices), (batch_axis,))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec(batch_axis))
        self.stacked_batch_sharding = NamedSharding(self.mesh, PartitionSpec(None, batch_axis))
        process = jax.process_index()
        self.local_devices = [d for d in devices if d.process_index == process]
        self.multiprocess = len(self.local_devices) != len(devices)
        # The batch is split into one shard per position along the data axis;
        # a process holds the shards of the positions its devices sit at.
        positions = np.moveaxis(self.mesh.devices, self.mesh.axis_names.index(batch_axis), 0)
        self.n_shards = positions.shape[0]
        self.n_local_shards = sum(
            any(d.process_index == process for d in np.ravel(row)) for row in positions
        )

    @property
    def n_devices(self) -> int:
        r"""the number of devices in the mesh, over every process."""
        return len(self.devices)

    @property
    def n_local_devices(self) -> int:
        r"""the number of devices in the mesh attached to this process."""
        return len(self.local_devices)

    @property
    def dispatch_depth(self) -> int:
        r"""how many steps may be queued on the devices at once."""
        on_cpu = self.devices[0].platform == "cpu"
        if on_cpu and self.n_devices > 1:
            return CPU_COLLECTIVE_DISPATCH_DEPTH
        return DEFAULT_DISPATCH_DEPTH

    def replicate(self, tree: Any, keep_host: bool = False) -> Any:
        r"""Places a pytree of host or device arrays on every device (`place`)."""
        return self.place(tree, jax.tree.map(lambda _: self.replicated, tree), keep_host)

    def place(self, tree: Any, shardings: Any, keep_host: bool = False) -> Any:
        r"""Places a pytree of host or device arrays with the given shardings
        (a tree of `NamedSharding` objects of the same structure); with
        `keep_host` (one process only), numpy arrays stay on the host, for
        a program's call to transfer (`jax.device_put` costs ~40 us a leaf)."""
        if not self.multiprocess:
            return _put(tree, shardings, keep_host)

        def place(leaf: Any, sharding: NamedSharding) -> jax.Array:
            if _in_place(leaf, sharding):
                return leaf
            if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
                data = place(jax.random.key_data(leaf), sharding)
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
            host = to_host(leaf)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(place, tree, shardings)

    def batch_shardings(self, tree: Any, stacked: bool = False) -> Any:
        r"""The layout of a batch (leaves with a `shape`): each leaf split
        along its batch axis (the first; the second with `stacked`) where its
        size divides by the shards, whole on every device where it does not
        (a graph batch's leaf of another size).

        >>> placement = Placement(jax.devices()[:1])
        >>> placement.batch_shardings([np.zeros((8, 3))]) == [placement.batch_sharding]
        True
        """
        sharding = self.stacked_batch_sharding if stacked else self.batch_sharding
        axis, n_shards = int(stacked), self.n_shards
        return jax.tree.map(
            lambda leaf: sharding if leaf.shape[axis] % n_shards == 0 else self.replicated, tree
        )

    def shard_batch(self, tree: Any, stacked: bool = False) -> Any:
        r"""Splits the process-local batch along its batch axis over the mesh.

        With `stacked`, the leaves hold several batches along a leading axis
        and the batch axis is the second one.
        """
        sharding = self.stacked_batch_sharding if stacked else self.batch_sharding
        if not self.multiprocess:
            return jax.device_put(tree, self.batch_shardings(tree, stacked))

        def place(leaf: Any) -> jax.Array:
            if isinstance(leaf, jax.Array):
                leaf = to_host(leaf)
            return jax.make_array_from_process_local_data(sharding, leaf)

        return jax.tree.map(place, tree)

    def feed_batch(self, tree: Any) -> Any:
        r"""A batch of one process as the compiled step takes it.

        Numpy leaves stay as they are (the step's call copies them to the
        devices, the cheapest way); JAX arrays that live elsewhere (say,
        committed to one device of several) are moved onto the batch's
        devices. An array already laid out as the batch is (on one device,
        `jax.device_put(x, device)` is) stays as it is: a copy of it every
        step would cost the reading thread more than a small step.
        """

        def place(leaf: Any) -> Any:
            if isinstance(leaf, jax.Array):
                wanted = self.batch_shardings(leaf)
                if leaf.sharding != wanted and not leaf.sharding.is_equivalent_to(
                    wanted, leaf.ndim
                ):
                    return jax.device_put(leaf, wanted)
            return leaf

        return jax.tree.map(place, tree)


class InFlight:
    r"""A bound on the steps queued on the devices, for every loop that dispatches.

    >>> queue = InFlight(depth=2)
    >>> for step in range(5):
    ...     queue.push(jax.numpy.ones(()) * step)   # waits for step - 2 first
    >>> len(queue)
    2
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._queue: deque[jax.Array] = deque()

    def push(self, marker: jax.Array) -> None:
        r"""Notes a dispatched computation; waits for the oldest beyond the depth."""
        self._queue.append(marker)
        if len(self._queue) > self.depth:
            self._queue.popleft().block_until_ready()

    def __len__(self) -> int:
        return len(self._queue)


def to_host(tree: Any) -> Any:
    r"""Numpy copies of a pytree of arrays.

    An array split over several processes' devices is gathered from all of
    them: a collective, so every process must call it at the same point.
    """

    def fetch(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            if leaf.sharding.is_fully_replicated:
                return np.asarray(leaf.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.asarray(leaf)

    return jax.tree.map(fetch, tree)


def gather_split(tree: Any) -> Any:
    r"""The tree with each array split over several processes gathered into
    a numpy array (the other leaves as they are).

    A collective when the tree holds such arrays: every process calls it at
    the same point, with trees of the same structure.
    """

    def gather(leaf: Any) -> Any:
        if (
            isinstance(leaf, jax.Array)
            and not leaf.is_fully_addressable
            and not leaf.sharding.is_fully_replicated
        ):
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return leaf

    return jax.tree.map(gather, tree)


def key_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    r"""A pytree key path as the plain names a user writes, `("Dense_0", "kernel")`."""

    def name(entry: Any) -> str:
        for attribute in ("key", "name", "idx"):
            if hasattr(entry, attribute):
                return str(getattr(entry, attribute))
        return str(entry)

    return tuple(name(entry) for entry in path)


def _put(tree: Any, shardings: Any, keep_host: bool = False) -> Any:
    r"""`jax.device_put(tree, shardings)`, the leaves already in place (committed
    to their sharding) taken as they are, as `device_put` would return them,
    without its cost (~17 us a leaf: a set-up's state placed again); with
    `keep_host`, numpy arrays left as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)  # type: ignore[attr-defined]
    moved = [
        index
        for index, (leaf, sharding) in enumerate(zip(leaves, targets))
        if not (keep_host and isinstance(leaf, np.ndarray)) and not _in_place(leaf, sharding)
    ]
    if moved:
        put = jax.device_put(
            [leaves[index] for index in moved], [targets[index] for index in moved]
        )
        for index, leaf in zip(moved, put):
            leaves[index] = leaf
    return jax.tree.unflatten(treedef, leaves)


def _in_place(leaf: Any, sharding: Any) -> bool:
    r"""Whether `leaf` is a device array committed to `sharding` (placing it
    there again would return it as it is)."""
    return (
        isinstance(leaf, jax.Array)
        and getattr(leaf, "committed", False)
        and leaf.sharding == sharding
    )
