r"""Batch forms accepted by the loops, their normalization and validation.

A data stream yields batches in any of these forms, as tuples or lists (a
PyTorch `DataLoader` yields lists):

- `(x, y)`
- `((x, ...), (y, ...))`
- `((x, ...), ())` — no targets

Normalized, a batch is `((x, ...), (y, ...))`: inputs go to
`apply(variables, *inputs)`, targets to `loss(*outputs, *targets)`. Leaves
become numpy arrays (JAX arrays are kept as they are), with 64-bit types
narrowed as JAX narrows them unless `jax_enable_x64` is set.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from flax_loop.errors import BatchError

Leaf = np.ndarray | jax.Array
Inputs = tuple[Leaf, ...]
Targets = tuple[Leaf, ...]
Batch = tuple[Inputs, Targets]
UnnormalizedInputs = Any
UnnormalizedBatch = Any
DataStream = Iterator[UnnormalizedBatch] | Iterable[UnnormalizedBatch]


def _is_array_like(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _as_leaf(value: Any, where: str) -> Leaf:
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, (dict, set, str, bytes)) or value is None:
        raise BatchError(
            f"{where} is a {type(value).__name__} ({_preview(value)}); "
            "expected an array (numpy, JAX, or anything np.asarray accepts)."
        )
    try:
        array = np.asarray(value)
    except Exception as error:  # np.asarray raises many types
        raise BatchError(
            f"{where} of type {type(value).__name__} cannot be converted to an "
            f"array (ragged or mixed values?): {str(error).rstrip('.')}."
        ) from None
    if array.dtype == object:
        raise BatchError(
            f"{where} ({_preview(value)}) converts to an object array; "
            "expected numbers of one shape (a ragged list?)."
        )
    canonical = jax.dtypes.canonicalize_dtype(array.dtype)
    return array if array.dtype == canonical else array.astype(canonical)


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def normalize_group(group: Any, where: str) -> tuple[Leaf, ...]:
    r"""Normalizes inputs or targets into a tuple of array leaves.

    A tuple is always a group of arrays; a list is a group when each of its
    items is an array (as a `DataLoader` yields), otherwise it is one array.

    Args:
        group: an array, or a tuple or list of arrays.
        where: how to name the group in an error message.

    Returns:
        a tuple of numpy or JAX arrays.
    """
    if isinstance(group, tuple) or (
        isinstance(group, list) and group and all(map(_is_array_like, group))
    ):
        return tuple(_as_leaf(item, f"{where}[{i}]") for i, item in enumerate(group))
    return (_as_leaf(group, where),)


def normalize_batch(batch: UnnormalizedBatch) -> Batch:
    r"""Converts a batch to its normalized form `((x, ...), (y, ...))`.

    Args:
        batch: a batch in one of the accepted forms.

    Returns:
        the normalized batch.

    Raises:
        BatchError: if the batch is not a pair of inputs and targets.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        kind = (
            f"a {type(batch).__name__} of length {len(batch)}"
            if isinstance(batch, (tuple, list))
            else f"a {type(batch).__name__}"
        )
        hint = ""
        if isinstance(batch, dict) and batch:
            keys = list(batch)
            pair = f"(batch[{keys[0]!r}], batch[{keys[-1]!r}])" if len(keys) > 1 else None
            hint = (
                f" For a dict, yield {pair} from the stream"
                if pair
                else " For a dict, yield (inputs, targets) pairs from the stream"
            ) + (
                ", or give TrainTask(compute_loss=fn), which takes the batch as it is (any pytree)."
            )
        raise BatchError(
            f"A batch must be a pair (inputs, targets), such as (x, y), "
            f"((x, ...), (y, ...)) or ((x, ...), ()); got {kind}: "
            f"{_preview(batch)}.{hint}"
        )
    inputs = normalize_group(batch[0], "inputs")
    if not inputs:
        raise BatchError("A batch has no inputs: got an empty inputs group ().")
    targets = normalize_group(batch[1], "targets") if _has_items(batch[1]) else ()
    return inputs, targets


def _has_items(group: Any) -> bool:
    return not (isinstance(group, (tuple, list)) and len(group) == 0)


class BatchTree:
    r"""Batches of any structure (`TrainTask(compute_loss=...)`), carried as
    their leaves: the normalized batch is `((leaf, ...), ())`, and
    `unflatten` gives the structure back inside the step.

    >>> tree = BatchTree()
    >>> tree({"image": np.zeros((8, 3)), "label": np.zeros(8, np.int32)})[0][1].shape
    (8,)
    >>> sorted(tree.unflatten(((np.zeros(2), np.ones(2)), ())))
    ['image', 'label']
    """

    def __init__(self) -> None:
        self.treedef: Any = None

    def __call__(self, batch: UnnormalizedBatch) -> Batch:
        r"""The batch's leaves as a normalized batch.

        Raises:
            BatchError: if it holds no array, a leaf is not an array, or its
                structure differs from the first batch's.
        """
        paths, treedef = jax.tree_util.tree_flatten_with_path(batch)
        if not paths:
            raise BatchError(f"A batch holds no arrays: got {_preview(batch)}.")
        if self.treedef is None:
            self.treedef = treedef
        elif treedef != self.treedef:
            raise BatchError(
                f"A batch's structure differs from the first batch's: expected "
                f"{self.treedef}, got {treedef}. Every batch must keep the first's keys."
            )
        return (
            tuple(_as_leaf(leaf, f"batch{jax.tree_util.keystr(path)}") for path, leaf in paths),
            (),
        )

    def unflatten(self, batch: Batch) -> Any:
        r"""The batch as the stream gave it, from its normalized form."""
        return jax.tree.unflatten(self.treedef, batch[0])


@dataclass(frozen=True)
class BatchSpec:
    r"""The shapes and dtypes every batch of a stream must keep.

    >>> spec = BatchSpec.of(normalize_batch((np.zeros((8, 3)), np.zeros(8))))
    >>> spec.describe()
    'inputs (8, 3) float32; targets (8,) float32'
    >>> spec.validate(normalize_batch((np.zeros((4, 3)), np.zeros(4))), step=7)
    Traceback (most recent call last):
    ...
    flax_loop.errors.BatchError: The batch at step 7 differs from the first batch ...
    """

    inputs: tuple[tuple[tuple[int, ...], np.dtype], ...]
    r"""shape and dtype of each input."""

    targets: tuple[tuple[tuple[int, ...], np.dtype], ...]
    r"""shape and dtype of each target."""

    @classmethod
    def of(cls, batch: Batch) -> "BatchSpec":
        r"""Takes the spec of a normalized batch."""
        inputs, targets = batch
        return cls(
            inputs=tuple((tuple(x.shape), np.dtype(x.dtype)) for x in inputs),
            targets=tuple((tuple(y.shape), np.dtype(y.dtype)) for y in targets),
        )

    @property
    def batch_size(self) -> int:
        r"""the examples a batch holds: the size of the leading axis its
        arrays share, or for a batch whose arrays differ there (a graph
        batch: nodes, a graph id per node, a label per graph) the smallest."""
        return min(shape[0] for shape, _ in self.inputs + self.targets)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        r"""every array's shape, inputs then targets."""
        return tuple(shape for shape, _ in self.inputs + self.targets)

    def describe(self) -> str:
        r"""Renders the spec as `inputs (8, 3) float32; targets (8,) int32`."""

        def group(specs: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> str:
            return ", ".join(f"{shape} {dtype}" for shape, dtype in specs) or "()"

        return f"inputs {group(self.inputs)}; targets {group(self.targets)}"

    def check_batch_axis(self, n_shards: int, step: int | None = None, whole: bool = False) -> None:
        r"""Checks that every array has a leading axis to split into `n_shards`.

        A batch without targets (a batch of any structure) may hold arrays
        of different leading sizes (a graph batch); each is split where its
        size divides by `n_shards` and is whole on every device where it
        does not, unless `whole` is false (several processes: each feeds
        its share of every array). Other batches share one leading size,
        which divides by `n_shards`.

        Raises:
            BatchError: if an array is a scalar, leading axes differ where
                they must not, or a batch size does not divide by `n_shards`.
        """
        shapes = list(self.shapes)
        if self.targets or len({shape[:1] for shape in shapes}) == 1:
            leading_size(shapes, n_shards=n_shards, step=step, describe=self.describe)
            return
        at = "" if step is None else f" at step {step}"
        for index, shape in enumerate(shapes):
            if not shape:
                raise BatchError(
                    f"A batch{at} holds a scalar (its leaf {index}); every array needs a "
                    f"leading axis. Got {self.describe()}."
                )
            if not whole and shape[0] % n_shards:
                raise BatchError(
                    f"The batch's leaf {index}{at}, of shape {shape}, does not split over "
                    f"{n_shards} devices: with several processes every array is split "
                    f"along its first axis. Pad it to a multiple of {n_shards} "
                    f"({self.describe()})."
                )

    def shorter(self, batch: Batch) -> bool:
        r"""Whether `batch` is this spec but for a smaller batch size."""
        received = BatchSpec.of(batch)
        mine, theirs = self.inputs + self.targets, received.inputs + received.targets
        if len(received.inputs) != len(self.inputs) or len(mine) != len(theirs):
            return False
        if any(not shape for shape, _ in theirs):
            return False
        sizes = {shape[0] for shape, _ in theirs}
        return (
            len(sizes) == 1
            and 0 < sizes.pop() < self.batch_size
            and all(
                shape[1:] == want[1:] and dtype == want_dtype
                for (shape, dtype), (want, want_dtype) in zip(theirs, mine)
            )
        )

    def same_kind(self, other: "BatchSpec") -> bool:
        r"""Whether `other` has this spec's arrays and dtypes, each of the same
        rank: a batch of other sizes only (another bucket)."""
        mine, theirs = self.inputs + self.targets, other.inputs + other.targets
        return (
            len(other.inputs) == len(self.inputs)
            and all(
                len(shape) == len(want) and dtype == want_dtype
                for (shape, dtype), (want, want_dtype) in zip(theirs, mine, strict=False)
            )
            and len(mine) == len(theirs)
        )

    def validate(
        self,
        batch: Batch,
        step: int | None = None,
        max_shapes: int | None = None,
        multiprocess: bool = False,
    ) -> None:
        r"""Checks that a batch has exactly this spec.

        Args:
            batch: the batch.
            step: the step it is for, to name.
            max_shapes: the most shapes a run takes, when other sizes of the
                same arrays are taken (named in the message), else `None`.
            multiprocess: several processes train (they keep one shape).

        Raises:
            BatchError: naming the first array that differs, both the
                expected and the received shapes, and what to do.
        """
        received = BatchSpec.of(batch)
        if received == self:
            return
        at = "" if step is None else f" at step {step}"
        mine, theirs = self.inputs + self.targets, received.inputs + received.targets
        differing = next(
            (
                index
                for index, (got, want) in enumerate(zip(theirs, mine, strict=False))
                if got != want
            ),
            min(len(mine), len(theirs)),
        )
        if self.same_kind(received):
            remedy = (
                "With several processes every batch keeps the first batch's shapes: "
                "pad them to one size."
                if multiprocess
                else f"A run takes at most {max_shapes} batch shapes, each compiling a step: "
                "pad the batches to fewer sizes (buckets)."
            )
        else:
            remedy = (
                "Every batch keeps the first batch's arrays, dtypes and ranks (its sizes "
                "may change: each new shape compiles a step)."
            )
        raise BatchError(
            f"The batch{at} differs from the first batch of the stream in its leaf "
            f"{differing}: expected {self.describe()}, got {received.describe()}. {remedy}"
        )


def leading_size(
    shapes: list[tuple[int, ...]],
    n_shards: int | None = None,
    step: int | None = None,
    describe: Callable[[], str] | None = None,
) -> int:
    r"""The leading (batch) axis shared by arrays of these shapes.

    The one check of the batch axis, for training and evaluation batches.

    >>> leading_size([(8, 3), (8,)], n_shards=4)
    8

    Args:
        shapes: the shapes of a batch's arrays.
        n_shards: if given, the batch must split evenly into this many shards.
        step: the step the batch is for, to name in a message.
        describe: the batch as a message shows it, made when one is raised
            (its shapes by default).

    Raises:
        BatchError: if an array is a scalar, leading axes differ, or the
            batch does not split into `n_shards`.
    """
    at = "" if step is None else f" at step {step}"

    def described() -> str:
        return describe() if describe else f"shapes {[tuple(shape) for shape in shapes]}"

    if any(len(shape) == 0 for shape in shapes):
        raise BatchError(
            f"A batch{at} holds a scalar; every array needs a leading batch axis. "
            f"Got {described()}."
        )
    sizes = sorted({shape[0] for shape in shapes})
    if len(sizes) != 1:
        raise BatchError(
            f"The arrays of a batch{at} have different leading (batch) sizes {sizes}: "
            f"{described()}."
        )
    size = sizes[0]
    if n_shards is not None and (size == 0 or size % n_shards):
        raise BatchError(
            f"A batch{at} of size {size} does not split evenly across {n_shards} "
            f"devices ({described()}); use a batch size that is a positive multiple "
            f"of {n_shards}."
        )
    return int(size)
