r"""What a listing of checkpoint files reads without JAX: the files' names
and the record of the frozen parameters a file left out.

`flax-loop ls`, `verify` and `show` import this, `_format` and `_inventory`
only, so that they start without loading JAX.
"""

from dataclasses import dataclass
from typing import Any

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

    def to_meta(self) -> dict[str, Any]:
        return {"paths": list(self.paths), "digest": self.digest}

    @classmethod
    def from_meta(cls, meta: Any) -> "LeftOut | None":
        if not isinstance(meta, dict):
            return None
        return cls(tuple(str(path) for path in meta.get("paths", ())), str(meta.get("digest")))
