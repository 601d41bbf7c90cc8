"""Writes the Sphinx inventories the site links JAX's, Flax's and Optax's
documentation with (intersphinx), so that it builds offline.

Each entry is a page of the project's published documentation, as that
project's own Sphinx sources lay it out (JAX's and Optax's autosummary
pages, Flax's API reference pages). Run it after adding an entry:

    python docs/_inventories/make_inventories.py
"""

import os
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))

PROJECTS = {
    "jax": ("JAX", "https://docs.jax.dev/en/latest/"),
    "flax": ("Flax", "https://flax.readthedocs.io/en/latest/"),
    "flax-linen": ("Flax Linen", "https://flax-linen.readthedocs.io/en/latest/"),
    "optax": ("Optax", "https://optax.readthedocs.io/en/latest/"),
}
r"""name: (title, the documentation's base URL)."""

ENTRIES = {
    "jax": [
        ("jax.jit", "py:function", "_autosummary/jax.jit.html#$"),
        ("jax.shard_map", "py:function", "_autosummary/jax.shard_map.html#$"),
        ("jax.random.key", "py:function", "_autosummary/jax.random.key.html#$"),
        (
            "jax.distributed.initialize",
            "py:function",
            "_autosummary/jax.distributed.initialize.html#$",
        ),
        ("jax.sharding.Mesh", "py:class", "jax.sharding.html#$"),
        ("jax.sharding.NamedSharding", "py:class", "jax.sharding.html#$"),
        ("jax.sharding.PartitionSpec", "py:class", "jax.sharding.html#$"),
    ],
    "flax": [("flax.nnx.Module", "py:class", "api_reference/flax.nnx/module.html#$")],
    "flax-linen": [("flax.linen.Module", "py:class", "api_reference/flax.linen/module.html#$")],
    "optax": [
        ("optax.GradientTransformation", "py:class", "api/generated/$.html#$"),
        ("optax.MultiSteps", "py:class", "api/generated/$.html#$"),
        ("optax.adam", "py:function", "api/generated/$.html#$"),
        ("optax.adamw", "py:function", "api/generated/$.html#$"),
        ("optax.contrib.reduce_on_plateau", "py:function", "api/generated/$.html#$"),
        ("optax.lbfgs", "py:function", "api/generated/$.html#$"),
        ("optax.polyak_sgd", "py:function", "api/generated/$.html#$"),
        ("optax.sgd", "py:function", "api/generated/$.html#$"),
    ],
}
r"""name: [(object, domain:role, its page relative to the base, where `$`
stands for the object's name)]."""


def inventory(name: str) -> bytes:
    r"""The inventory file of project `name`: Sphinx's version 2 format."""
    title, _ = PROJECTS[name]
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {title}\n"
        "# Version: latest\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    lines = "".join(
        f"{obj} {role} 1 {uri.replace('$', obj)} -\n" for obj, role, uri in ENTRIES[name]
    )
    return header.encode() + zlib.compress(lines.encode(), 9)


def path(name: str) -> str:
    r"""Where project `name`'s inventory is kept."""
    return os.path.join(HERE, f"{name}.inv")


def write(name: str) -> str:
    with open(path(name), "wb") as file:
        file.write(inventory(name))
    return path(name)


if __name__ == "__main__":
    for project in PROJECTS:
        print(write(project))
