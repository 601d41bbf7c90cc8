r"""Programs compiled once for every restart: JAX's persistent compilation
cache, on by default in the user's cache folder.

A run restarted in a new process (a resume after preemption) compiles the
same programs again; JAX's persistent cache keeps them on disk, keyed by
what they compute, so a second process takes them from there. `use()`
turns it on before set-up compiles anything, unless the program said
otherwise:

- `JAX_COMPILATION_CACHE_DIR` (or `jax.config.update("jax_compilation_cache_dir",
  ...)`) moves it: that folder is used as it is;
- `JAX_ENABLE_COMPILATION_CACHE=false` (or the `jax_enable_compilation_cache`
  option) turns it off.

Otherwise it lives in `$XDG_CACHE_HOME/flax_loop/jax` (`~/.cache/flax_loop/jax`),
caches every program (JAX's default skips those compiled in under a
second: a small model's) and is trimmed to `MAX_BYTES`, the entries least
recently used first. Several processes may share it: an entry is written
under its own name, and an entry read while another process writes it is
compiled again (JAX checks every entry it reads).

>>> import jax
>>> hits = CacheHits()
>>> hits.count >= 0
True
"""

import os
from pathlib import Path
from typing import Any

import jax

MAX_BYTES = 2 * 1024**3
r"""The most the default folder holds; set-up trims it to this."""

_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def default_folder() -> Path:
    r"""`$XDG_CACHE_HOME/flax_loop/jax`, `~/.cache/flax_loop/jax` by default."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flax_loop" / "jax"


def folder_in_use() -> str | None:
    r"""The persistent cache's folder, if one is set."""
    config: Any = jax.config
    return config.jax_compilation_cache_dir or None


def use() -> str | None:
    r"""Turns the persistent compilation cache on in the default folder,
    unless the program set a folder or turned it off; returns the folder
    in use (`None`: off, or the folder cannot be made)."""
    config: Any = jax.config  # its options are attributes made at run time
    if not config.jax_enable_compilation_cache:
        return None
    chosen = config.jax_compilation_cache_dir
    if chosen:
        return str(chosen)
    folder = default_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    trim(folder, MAX_BYTES)  # once a process: the folder is set from here on
    config.update("jax_compilation_cache_dir", str(folder))
    if config.jax_persistent_cache_min_compile_time_secs == 1.0:  # JAX's default
        config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return str(folder)


def trim(folder: Path, max_bytes: int) -> None:
    r"""Removes the entries used least recently until `folder` holds at most
    `max_bytes` (another process removing one meanwhile is no error)."""
    entries = []
    for entry in folder.glob("*-cache"):
        try:
            stat = entry.stat()
        except OSError:
            continue
        entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, entry))
    total = sum(size for _, size, _ in entries)
    for _, size, entry in sorted(entries, key=lambda item: item[0]):
        if total <= max_bytes:
            return
        try:
            entry.unlink()
            total -= size
        except OSError:
            continue


class CacheHits:
    r"""Counts the programs JAX takes from the persistent cache, from when it
    is made (JAX reports each hit as an event)."""

    _count = 0
    _listening = False

    def __init__(self) -> None:
        if not CacheHits._listening:
            jax.monitoring.register_event_listener(_count_hit)
            CacheHits._listening = True
        self._start = CacheHits._count

    @property
    def count(self) -> int:
        r"""the hits since this counter was made."""
        return CacheHits._count - self._start


def _count_hit(event: str, **kwargs: str | int) -> None:
    if event == _CACHE_HIT:
        CacheHits._count += 1
