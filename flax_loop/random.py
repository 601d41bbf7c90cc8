r"""Random keys: the run's key, and keys derived from it on the device.

A loop holds one typed key, the run's. From it derive, and only here:

- `init_key(key)`: the model's initialization;
- `train_key(key)`, then `step_keys(train_key, step, device_index, labels)`
  inside the compiled update, so the host never splits keys per step and a
  resumed run draws the same numbers as one that never stopped;
- `eval_key(key, step, batch_index)`: an evaluation's batches.

>>> key = jax.random.key(0)
>>> keys = step_keys(train_key(key), step=1, device_index=0, labels=["dropout"])
>>> sorted(keys)
['dropout']
"""

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from flax_loop.errors import ConfigError

KeyGenerator = Iterator[jax.Array]


def as_typed_key(key: Any) -> jax.Array:
    r"""Returns a typed key for a typed key or a legacy `uint32[2]` key.

    Args:
        key: `jax.random.key(seed)` or `jax.random.PRNGKey(seed)`.

    Raises:
        ConfigError: if `key` is neither.
    """
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if getattr(key, "shape", None) != ():
            raise ConfigError(f"rnkey must be a single key; got a key array of shape {key.shape}.")
        return key
    if dtype is not None and np.dtype(dtype) == np.uint32 and np.shape(key) == (2,):
        return jax.random.wrap_key_data(key)
    raise ConfigError(
        f"rnkey must be jax.random.key(seed) or jax.random.PRNGKey(seed); "
        f"got {type(key).__name__} {getattr(key, 'shape', '')} "
        f"{getattr(key, 'dtype', '')}."
    )


def init_key(key: jax.Array) -> jax.Array:
    r"""The key that initializes the model."""
    return jax.random.fold_in(key, 0)


def train_key(key: jax.Array) -> jax.Array:
    r"""The key every training step's keys derive from (with `step_keys`)."""
    return jax.random.fold_in(key, 1)


def eval_key(key: jax.Array, step: int | jax.Array, batch_index: int | jax.Array) -> jax.Array:
    r"""The key of one evaluation batch of the checkpoint at `step`."""
    return jax.random.fold_in(jax.random.fold_in(key, step), batch_index)


def into_collection(key: jax.Array, labels: Sequence[str]) -> dict[str, jax.Array]:
    r"""Derives one key per RNG collection label, e.g. `{"dropout": key}`.

    Works on the host and inside compiled code.
    """
    return {label: jax.random.fold_in(key, i) for i, label in enumerate(labels)}


def step_keys(
    key: jax.Array,
    step: jax.Array,
    device_index: int | jax.Array,
    labels: Sequence[str],
) -> dict[str, jax.Array]:
    r"""Keys of one step on one device, derived on the device.

    Args:
        key: the run's training key.
        step: the number of the step being computed (1-based).
        device_index: the index of the device along the data axis.
        labels: RNG collection labels, e.g. `["dropout"]`.

    Returns:
        a mapping from label to key.
    """
    per_step = jax.random.fold_in(key, step)
    per_device = jax.random.fold_in(per_step, device_index)
    return into_collection(per_device, labels)


LOSS_STREAM = 2**31 - 1
r"""What `loss_key` folds into a step's key on a device; no RNG label's index
(`into_collection` folds in 0, 1, ...) comes near it."""


def loss_key(key: jax.Array, step: jax.Array, device_index: int | jax.Array) -> jax.Array:
    r"""The key `compute_loss(..., rng=...)` gets for one step on one device,
    apart from the model's RNG collections (`step_keys`)."""
    per_device = jax.random.fold_in(jax.random.fold_in(key, step), device_index)
    return jax.random.fold_in(per_device, LOSS_STREAM)


def into_sequence(key: Any) -> KeyGenerator:
    r"""An endless generator of fresh keys split from `key`.

    >>> keys = into_sequence(jax.random.key(0))
    >>> first, second = next(keys), next(keys)
    >>> bool(jax.random.key_data(first)[0] != jax.random.key_data(second)[0])
    True
    """
    current = as_typed_key(key)
    while True:
        current, fresh = jax.random.split(current)
        yield fresh


def sequence(seed: int, num: int = 1) -> KeyGenerator | list[KeyGenerator]:
    r"""Creates `num` independent key generators from an integer seed.

    >>> rnkeyg = sequence(seed=0)
    >>> next(rnkeyg).shape
    ()
    """
    root = jax.random.key(seed)
    if num == 1:
        return into_sequence(root)
    return [into_sequence(key) for key in jax.random.split(root, num)]


def split_per_device(key: Any, n_devices: int) -> jax.Array:
    r"""Splits a key into `n_devices` keys (kept for programs that call it)."""
    return jax.random.split(as_typed_key(key), n_devices)


def labels_of(collections: Mapping[str, Sequence[str]] | None, kind: str) -> list[str]:
    r"""The RNG labels for `kind` ("init" or "apply") in `collections`.

    >>> labels_of({"apply": ["dropout"]}, "init"), labels_of({"apply": ["dropout"]}, "apply")
    (['params'], ['dropout'])
    """
    defaults = {"init": ["params"], "apply": []}
    if collections is None:
        return defaults[kind]
    if not isinstance(collections, Mapping):
        raise ConfigError(
            f'collections must be a mapping such as {{"apply": ["dropout"]}}; got {collections!r}.'
        )
    labels = collections.get(kind, defaults[kind])
    if isinstance(labels, str) or not all(isinstance(label, str) for label in labels):
        raise ConfigError(
            f'collections["{kind}"] must be a list of RNG collection names '
            f'such as ["dropout"]; got {labels!r}.'
        )
    return list(labels)


def same_key(a: jax.Array, b: jax.Array) -> bool:
    r"""Whether two typed keys are the same key (implementation and data).

    >>> key = jax.random.key(0)
    >>> same_key(key, jax.random.key(0)), same_key(key, jax.random.key(1))
    (True, False)
    """
    if jax.random.key_impl(a) != jax.random.key_impl(b):
        return False
    # on the host: comparing on the device dispatches three programs
    first, second = (np.asarray(jax.random.key_data(key)) for key in (a, b))
    return bool(np.array_equal(first, second))
