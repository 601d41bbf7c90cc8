r"""Processes that must hold the same: their training states' structures."""

from typing import Any

import jax
import numpy as np

from flax_loop.distributed import gather, gather_objects, is_multiprocess
from flax_loop.errors import ConfigError


def agree_on_structure(name: str, tree: Any) -> None:
    r"""Checks that every process holds a tree of the same paths, shapes and
    dtypes (their models, optimizers and options agree), before any step
    runs a collective over mismatched arrays.

    Raises:
        ConfigError: naming the first path where a process differs from
            process 0, on every process.
    """
    if not is_multiprocess():
        return
    import zlib

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    described = [
        f"{jax.tree_util.keystr(path)} {tuple(np.shape(leaf))} {np.dtype(leaf.dtype).name}"
        for path, leaf in flat
    ]
    digests = gather(zlib.crc32("\n".join(described).encode()))
    if len(set(digests)) == 1:
        return
    everyone = gather_objects(f"structure/{name}", described)
    for index, theirs in enumerate(everyone[1:], start=1):
        if theirs == everyone[0]:
            continue
        first = next(
            (i for i, (a, b) in enumerate(zip(everyone[0], theirs)) if a != b),
            min(len(theirs), len(everyone[0])),
        )
        ours = everyone[0][first] if first < len(everyone[0]) else "nothing"
        other = theirs[first] if first < len(theirs) else "nothing"
        raise ConfigError(
            f"The processes' {name} differ: process 0 has {ours}, process {index} has "
            f"{other} (the first difference). Every process must build the same model, "
            "optimizer and options."
        )
