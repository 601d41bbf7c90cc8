r"""The feed's first stage: the task's data as a stream of raw batches, read
into the form the steps take and checked.

`DataSource` holds the stream and its position. A re-iterable source (a
list, a `DataLoader`, a grain dataset: anything whose `iter()` gives a fresh
iterator) is read epoch after epoch, its state being the epoch and the
batches read in it (with the iterator's own state, if it has one); a
one-shot iterator ends when it ends, its state being its own `get_state()`.

>>> source = DataSource([1, 2])
>>> [source.next() for _ in range(3)], source.snapshot()
([1, 2, 1], {'flax_loop/epoch': {'epoch': 1, 'batches': 1}})

`CheckedBatches` reads from a `DataSource`, puts the raw batches in the form
the steps take, and checks each against the first batch's `BatchSpec`: the
same leaves, dtypes and ranks. A batch of other sizes (a bucket) is taken,
said once, up to `MAX_SHAPES` shapes; a stream's shorter last batch (a
`DataLoader`'s, tf.data's) is trained on when it splits over the devices,
else dropped, never an error. Errors name the step the batch was for.

>>> import numpy as np
>>> from flax_loop.parallel import Placement
>>> batches = CheckedBatches([(np.zeros((8, 3)), np.zeros(8)), (np.zeros((8, 4, 1)), np.zeros(8))],
...                          Placement())
>>> first = batches.accept_first(batches.read(for_step=1))
>>> batches.spec.batch_size
8
>>> batches.read(for_step=2)
Traceback (most recent call last):
...
flax_loop.errors.BatchError: The batch at step 2 differs from the first batch ... in its leaf 0: ...
"""

import copy
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from flax_loop import distributed
from flax_loop.data.batch import Batch, BatchSpec, normalize_batch
from flax_loop.errors import BatchError, ConfigError, DataExhaustedError
from flax_loop.log import log
from flax_loop.parallel import Placement

EPOCH = "flax_loop/epoch"

MAX_SHAPES = 8
r"""The most batch shapes one run trains on (the first batch's included):
each compiles a step of its own."""
r"""The key of a re-iterable source's data state; the epoch, and the position in it."""


class DataSource:
    r"""The raw batches of `data`, epoch after epoch if it is re-iterable.

    Raises:
        ConfigError: if `data` cannot be iterated.
    """

    def __init__(self, data: Any) -> None:
        try:
            iterator = iter(data)
        except TypeError as error:
            raise ConfigError(
                f"task.data must be an iterator or iterable of batches; got {type(data).__name__}."
            ) from error
        self._source: Iterable[Any] | None = None if iterator is data else data
        self._iterator: Iterator[Any] = iterator
        self._epoch = 0
        self._position = 0  # batches read in this epoch
        self._peeked: Any = _NOTHING  # a batch read to see if the epoch ends

    @property
    def repeats(self) -> bool:
        r"""whether the source is read epoch after epoch."""
        return self._source is not None

    def next(self) -> Any:
        r"""The next raw batch (of the next epoch at an epoch's end).

        Raises:
            StopIteration: at a one-shot iterator's end, or an epoch without a batch.
        """
        try:
            if self._peeked is not _NOTHING:
                raw, self._peeked = self._peeked, _NOTHING
                self._position += 1
                return raw
            raw = next(self._iterator)
        except StopIteration:
            if self._source is None or self._position == 0:
                raise  # a one-shot iterator, or an epoch without a batch
            self._epoch, self._position = self._epoch + 1, 0
            self._iterator = iter(self._source)
            raw = next(self._iterator)
        self._position += 1
        return raw

    def ends_after(self) -> bool:
        r"""Whether the current iterator has no batch after the one just read."""
        if self._peeked is _NOTHING:
            try:
                self._peeked = next(self._iterator)
            except StopIteration:
                return True
        return False

    def snapshot(self) -> Any:
        r"""The source's state now (a deep copy); `None` if it has none."""
        get_state = getattr(self._iterator, "get_state", None)
        if self._source is not None:
            position: dict[str, Any] = {"epoch": self._epoch, "batches": self._position}
            if callable(get_state):
                position["state"] = get_state()
            return copy.deepcopy({EPOCH: position})
        if callable(get_state):
            return copy.deepcopy(get_state())
        return None

    def reposition(self, state: Any) -> str | None:
        r"""Repositions the source at a `snapshot()`; `None` if done, or why it
        cannot be (then the source is as it was)."""
        set_state = getattr(self._iterator, "set_state", None)
        if self._source is None and not callable(set_state):
            return "it has no get_state/set_state"
        if state is None:
            return "the checkpoint holds no state of it, or one of another number of processes"
        if self._source is not None:
            if not (isinstance(state, dict) and isinstance(state.get(EPOCH), dict)):
                return "the checkpoint's data state is not that of a re-iterable source"
            self._peeked = _NOTHING
            saved = state[EPOCH]
            self._iterator, self._epoch = iter(self._source), int(saved.get("epoch", 0))
            set_state = getattr(self._iterator, "set_state", None)
            if "state" in saved and callable(set_state):
                set_state(saved["state"])
                self._position = int(saved.get("batches", 0))
                return None
            self._position = 0
            for _ in range(int(saved.get("batches", 0))):  # skip what was trained on
                self.next()
            return None
        assert callable(set_state)
        self._peeked = _NOTHING
        set_state(state)
        return None


_NOTHING = object()


class CheckedBatches:
    r"""The batches of `data`, in the steps' form and checked against the first.

    Args:
        data: the task's data: an iterator, or an iterable read epoch after epoch.
        placement: the devices the batches go to (a batch must split over them).
        normalize: `normalize(raw) -> Batch`: the batch form the steps take
            (`normalize_batch`, or a `BatchTree` for batches of any structure).

    Raises:
        ConfigError: if `data` cannot be iterated.
    """

    def __init__(
        self,
        data: Any,
        placement: Placement,
        normalize: Callable[[Any], Batch] = normalize_batch,
    ) -> None:
        self._data = data
        self.source = DataSource(data)
        self._placement = placement
        self._normalize = normalize
        self.spec: BatchSpec | None = None
        r"""the first batch's spec, once accepted (`accept_first`)."""
        self._size = 0
        self._plain: tuple[Any, ...] | None = None  # the spec of a plain (x, y)
        # a plain (x, y) of device arrays: their layouts, as the step takes them
        # (the first batch as `read` returned it, through `Placement.feed_batch`:
        # a later batch in the same layout needs no placing)
        self._plain_placed: tuple[Any, Any] | None = None
        # a batch of any structure (`BatchTree`): its structure and leaves' spec
        self._leaves: tuple[Any, tuple[Any, ...]] | None = None
        self._noted_drop = False
        self.other_shapes: list[BatchSpec] = []
        r"""the specs of the batches of other shapes met (buckets), in order:
        each has a step compiled for it (`MAX_SHAPES` at most)."""

    def accept_first(self, first: Batch | None) -> Batch:
        r"""Takes the first batch's spec, which later batches must match.

        Raises:
            DataExhaustedError: if there is no first batch.
            BatchError: if it does not split over the devices.
        """
        if first is None:
            data = self._data
            if inspect.isgenerator(data) and data.gi_frame is None:
                raise DataExhaustedError(
                    "task.data is a generator that has already run to its end (was it "
                    "read before, say by a first TrainLoop or a look at its batches?). "
                    "Make a new generator for this loop, or give a re-iterable source "
                    "(a list, a DataLoader, a grain dataset)."
                )
            raise DataExhaustedError(
                "task.data yielded no batch: the data stream is empty. Give it "
                "at least one batch (check the data set's size and batch size)."
            )
        self.spec = BatchSpec.of(first)
        placement = self._placement
        self.spec.check_batch_axis(placement.n_local_shards, whole=not placement.multiprocess)
        distributed.agree("the process-local batch size", self.spec.batch_size)
        self._size = self.spec.shapes[0][0]  # the first leaf's: a shorter batch's is less
        if len(self.spec.inputs) == len(self.spec.targets) == 1:
            self._plain = (*self.spec.inputs[0], *self.spec.targets[0])
            (x,), (y,) = first
            if isinstance(x, jax.Array) and isinstance(y, jax.Array) and not placement.multiprocess:
                self._plain_placed = (x.sharding, y.sharding)
        tree = getattr(self._normalize, "treedef", None)
        if tree is not None and not self.spec.targets:
            self._leaves = (tree, self.spec.inputs)
        return first

    def item(self, for_step: int) -> tuple[Batch, None] | None:
        r"""`read`'s batch as a read-ahead item without a data state (read
        inline, the source's own state is the checkpoint's); `None` at the end."""
        batch = self.read(for_step)
        return None if batch is None else (batch, None)

    def read(self, for_step: int) -> Batch | None:
        r"""The batch for `for_step`, normalized and validated; `None` at the end.

        Raises:
            BatchError: for a batch of the wrong form, naming the step.
            DataExhaustedError: at the end of one process's stream of several.
        """
        try:
            raw = self.source.next()
        except StopIteration:
            if self._placement.multiprocess:
                raise DataExhaustedError(
                    f"The data stream of process {jax.process_index()} ended before step "
                    f"{for_step}. With several processes every stream must yield a batch "
                    "for every step, so that all take the same steps: give each process "
                    "an endless or re-iterable source and stop with n_steps."
                ) from None
            return None
        except Exception as error:
            error.add_note(
                f"flax_loop: raised by task.data while reading the batch for step {for_step}"
            )
            raise
        # The common case, a plain (x, y) of exactly the first batch's spec
        # (numpy arrays, or device arrays laid out as the first batch's:
        # `Placement.feed_batch`), costs a few attribute reads.
        plain = self._plain
        if plain is not None and type(raw) in (tuple, list) and len(raw) == 2:
            x, y = raw
            x_shape, x_dtype, y_shape, y_dtype = plain
            placed = self._plain_placed
            if (
                (
                    (type(x) is np.ndarray and type(y) is np.ndarray)
                    or (
                        placed is not None
                        and isinstance(x, jax.Array)
                        and isinstance(y, jax.Array)
                        and x.sharding == placed[0]
                        and y.sharding == placed[1]
                    )
                )
                and x.shape == x_shape
                and y.shape == y_shape
                and x.dtype == x_dtype
                and y.dtype == y_dtype
            ):
                return (x,), (y,)
        leaves_spec = self._leaves
        if leaves_spec is not None:  # a batch of any structure, numpy leaves of the spec
            leaves, treedef = jax.tree.flatten(raw)
            if treedef == leaves_spec[0] and all(
                type(leaf) is np.ndarray and leaf.shape == shape and leaf.dtype == dtype
                for leaf, (shape, dtype) in zip(leaves, leaves_spec[1])
            ):
                return tuple(leaves), ()
        spec = self.spec
        try:
            batch = self._normalize(raw)
        except BatchError as error:
            raise BatchError(f"The batch for step {for_step}: {error}") from None
        smaller = spec is not None and batch[0][0].shape[:1] < (self._size,)
        if smaller and spec.shorter(batch) and self.source.ends_after():  # type: ignore[union-attr]
            return self._shorter_last(batch, for_step)
        if spec is not None and BatchSpec.of(batch) != spec:
            self._other_shape(batch, for_step)
        if not self._placement.multiprocess:
            batch = self._placement.feed_batch(batch)  # JAX arrays on other devices
        return batch

    def _other_shape(self, batch: Batch, for_step: int) -> None:
        r"""Accepts a batch of the first batch's structure and dtypes but of
        other sizes (a bucket of sequence lengths, a padded graph batch): its
        step is compiled when first met, which is said once.

        Raises:
            BatchError: naming the leaf that differs otherwise (structure,
                dtype, rank), the shapes past `MAX_SHAPES`, with several
                processes (which keep one shape), or a leaf that does not
                split over the devices.
        """
        spec, received = self.spec, BatchSpec.of(batch)
        assert spec is not None, "the first batch sets the spec"
        placement = self._placement
        if (
            placement.multiprocess
            or not spec.same_kind(received)
            or (received not in self.other_shapes and len(self.other_shapes) + 1 >= MAX_SHAPES)
        ):
            spec.validate(batch, for_step, MAX_SHAPES, placement.multiprocess)
        if received in self.other_shapes:
            return
        received.check_batch_axis(placement.n_local_shards, step=for_step, whole=True)
        self.other_shapes.append(received)
        log(
            f"Batches of {received.describe()} from step {for_step:,}: a step is compiled "
            f"for them (shape {len(self.other_shapes) + 1} of at most {MAX_SHAPES})."
        )

    def _shorter_last(self, batch: Batch, for_step: int) -> Batch | None:
        r"""A stream's shorter last batch: trained on if it splits over the
        devices, else dropped (the next epoch's first batch comes instead)."""
        size = batch[0][0].shape[0]
        placement = self._placement
        if size % placement.n_local_shards == 0 and not placement.multiprocess:
            return batch
        if not self._noted_drop:
            log(
                f"The stream's last batch holds {size} examples, which do not "
                f"split over {placement.n_local_shards} devices: it is "
                "dropped (each time the source ends with it)."
            )
            self._noted_drop = True
        return self.read(for_step) if self.source.repeats else None


class NoData:
    r"""The stream of a step that reads no data (`TrainTask(update=fn,
    data=None)`): a placeholder batch each step, one entry a device, which
    the step is not given."""

    def __init__(self, n_local_shards: int) -> None:
        self._batch = np.zeros((max(n_local_shards, 1),), np.uint8)

    def __iter__(self) -> "NoData":
        return self

    def __next__(self) -> np.ndarray:
        return self._batch

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        pass
