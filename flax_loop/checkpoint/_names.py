r"""What a listing of checkpoint files reads without JAX: the files' names,
the record of the frozen parameters a file left out, and the arrays' names
in a file's footer.

`flax-loop ls`, `verify` and `show` import this, `format`, `parse` and `_inventory`
only, so that they start without loading JAX.
"""

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

FORMAT_VERSION = 1
r"""The version of the file format this package writes (and the newest it reads)."""

SUFFIX = ".ckpt"
TEMPORARY_PREFIX = ".tmp."
REGULAR_PREFIX = "regular."


@dataclass(frozen=True)
class LeftOut:
    r"""The frozen parameters a file leaves out (`CheckpointFileWriter(save_frozen=False)`)."""

    paths: tuple[str, ...]
    r"""their paths in the parameters' state dict, `"/Dense_0/kernel"`."""

    digest: str
    r"""a digest of their values (`flax_loop.checkpoint._frozen.digest`)."""

    fields: tuple[str, ...] = ("model_params",)
    r"""the array fields they were left out of; the parameters, and the
    carried fields that mirror them (`Checkpoint.mirrors_params`)."""

    def to_meta(self) -> dict[str, Any]:
        return {"paths": list(self.paths), "digest": self.digest, "fields": list(self.fields)}

    @classmethod
    def from_meta(cls, meta: Any) -> "LeftOut | None":
        if not isinstance(meta, dict):
            return None
        # files written before the fields were recorded cut them from these two
        fields = meta.get("fields", _FIELDS_BEFORE_RECORDED)
        return cls(
            tuple(str(path) for path in meta.get("paths", ())),
            str(meta.get("digest")),
            tuple(str(name) for name in fields) if isinstance(fields, list) else (),
        )


_FIELDS_BEFORE_RECORDED = ["model_params", "ema_params"]


def array_names(tree: Any) -> dict[int, str]:
    r"""Each array's path in the footer's tree (`model_params/Dense_0/kernel`),
    by its index; arrays a damaged tree does not name are left out."""
    names: dict[int, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, msgpack.ExtType) and len(node.data) == 4:
            names.setdefault(struct.unpack("<I", node.data)[0], prefix)
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}/{key}" if prefix else str(key))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{prefix}/{index}")

    walk(tree, "")
    return names


def one_directory(owner: str, given: Any, alias: Any, name: str, alias_name: str) -> Any:
    r"""The directory a reader or writer was given as `name` or as its alias
    (readers take `dir=`, writers `output_dir=`: flax-extra's programs use
    both spellings).

    Raises:
        ConfigError: if neither is given, or both and they differ.
    """
    from flax_loop.errors import ConfigError

    if given is not None and alias is not None and given != alias:
        raise ConfigError(
            f"{owner} was given {name}={given!r} and {alias_name}={alias!r}: give the "
            f"directory once ({name}=...)."
        )
    chosen = given if given is not None else alias
    if chosen is None:
        raise ConfigError(f"{owner} needs {name}, the directory of its checkpoints.")
    return chosen
