r"""Batches stacked along a new leading axis: a dispatch of several steps
(`steps_per_dispatch`) takes its batches so.

>>> import numpy as np
>>> batch = ((np.zeros((8, 3), np.float32),), (np.zeros(8, np.int32),))
>>> stack([batch, batch])[0][0].shape
(2, 8, 3)
"""

from typing import Any

import numpy as np

from flax_loop.data.batch import Batch


def stack(batches: list[Batch]) -> Batch:
    r"""Stacks batches along a new leading axis, for several steps per dispatch."""
    first = batches[0]
    return tuple(  # type: ignore[return-value]
        tuple(
            _stack_leaves([batch[group][index] for batch in batches])
            for index in range(len(first[group]))
        )
        for group in range(len(first))
    )


def _stack_leaves(leaves: list[Any]) -> np.ndarray:
    first = leaves[0]
    if type(first) is not np.ndarray or first.dtype.hasobject:
        return np.stack(leaves)
    shape = (len(leaves), *first.shape)
    try:
        # One copy, by bytes.join, which beats np.concatenate and np.stack (a
        # view per leaf) on a dispatch's small batches. The leaves share the
        # first batch's dtype (each batch was checked against it).
        joined = b"".join(leaves)
    except (BufferError, TypeError, ValueError):  # not C-contiguous
        return np.concatenate(leaves).reshape(shape)
    return np.frombuffer(joined, first.dtype).reshape(shape)
