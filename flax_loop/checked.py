r"""The feed's first stage: the task's batches read, normalized and checked.

`CheckedBatches` reads raw batches from a `DataSource` (epoch after epoch
for a re-iterable source), puts them in the form the steps take, and checks
each against the first batch's `BatchSpec`: the same leaves, shapes and
dtypes. A stream's shorter last batch (a `DataLoader`'s, tf.data's) is
trained on when it splits over the devices, else dropped, never an error.
Errors name the step the batch was for.

>>> import numpy as np
>>> from flax_loop.checked import CheckedBatches
>>> from flax_loop.parallel import Placement
>>> batches = CheckedBatches([(np.zeros((8, 3)), np.zeros(8)), (np.zeros((8, 4)), np.zeros(8))],
...                          Placement())
>>> first = batches.accept_first(batches.read(for_step=1))
>>> batches.spec.batch_size
8
>>> batches.read(for_step=2)
Traceback (most recent call last):
...
flax_loop.errors.BatchError: The batch at step 2 differs from the first batch of the stream: ...
"""

import inspect
from collections.abc import Callable
from typing import Any

import jax

from flax_loop import distributed
from flax_loop.batch import Batch, BatchSpec, normalize_batch
from flax_loop.errors import BatchError, DataExhaustedError
from flax_loop.log import log
from flax_loop.parallel import Placement
from flax_loop.source import DataSource


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
        self._noted_drop = False

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
        self.spec.check_batch_axis(self._placement.n_local_shards)
        distributed.agree("the process-local batch size", self.spec.batch_size)
        self._size = self.spec.batch_size
        return first

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
        spec = self.spec
        if spec is not None:
            fast = spec.fast_path(raw)
            if fast is not None:
                return fast
        try:
            batch = self._normalize(raw)
        except BatchError as error:
            raise BatchError(f"The batch for step {for_step}: {error}") from None
        smaller = spec is not None and batch[0][0].shape[:1] < (self._size,)
        if smaller and spec.shorter(batch) and self.source.ends_after():  # type: ignore[union-attr]
            return self._shorter_last(batch, for_step)
        if spec is not None:
            spec.validate(batch, step=for_step)
        if not self._placement.multiprocess:
            batch = self._placement.feed_batch(batch)  # JAX arrays on other devices
        return batch

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
