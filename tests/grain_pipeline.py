"""A grain pipeline of digits, shared by the grain tests and their worker processes.

Its functions are module-level so that grain's `mp_prefetch` worker
processes can unpickle them.
"""

from typing import Any

import numpy as np


def scale(example: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return example[0] * 2.0 - 1.0, example[1]


def stack(rows: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
    return tuple(map(np.stack, zip(*rows)))


def pipeline(
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int = 32,
    seed: int = 0,
    shard: tuple[int, int] = (0, 1),
    workers: int = 0,
) -> Any:
    """Shuffled, scaled digits in batches (the partial one dropped): process
    `shard[0]` of `shard[1]` reads every `shard[1]`-th example; `workers`
    prefetching processes (`mp_prefetch`) when more than 0."""
    import grain

    index, count = shard
    dataset = (
        grain.MapDataset.source(list(zip(x, y)))
        .shuffle(seed=seed)
        .map(scale)[index::count]
        .batch(batch_size, drop_remainder=True, batch_fn=stack)
        .to_iter_dataset()
    )
    if workers:
        dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return dataset
