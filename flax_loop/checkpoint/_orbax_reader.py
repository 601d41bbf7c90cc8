r"""Reading an Orbax checkpoint directory: `OrbaxCheckpointReader`.

The newest intact step is restored straight into the resuming loop's own
layout (any device count, any sharding); a directory of parameters only
(Orbax's `StandardCheckpointer`) starts a run at step 0 from them.

>>> import tempfile
>>> import flax.linen as nn
>>> reader = OrbaxCheckpointReader(dir=tempfile.mkdtemp(), target=nn.Dense(3).init)
>>> reader.steps()  # nothing written yet: a loop given this reader starts at step 0
[]

`flax_loop.checkpoint._orbax` shows a directory written and read back.
"""

import os
from dataclasses import dataclass, field
from typing import Any

from flax_loop.checkpoint._checkpoint import CheckpointFile, check_held_as_saved
from flax_loop.checkpoint._names import one_directory
from flax_loop.checkpoint._orbax_store import (
    FORMAT_VERSION,
    META_ITEM,
    PARTS,
    STATE_ITEM,
    abstract_tree,
    check_compatible,
    decode_meta,
    first_line,
    orbax_module,
    quiet_async_failures,
    reading,
    restore_tree,
)
from flax_loop.checkpoint._reader import _names
from flax_loop.checkpoint.format import restore_key
from flax_loop.errors import CheckpointCorruptError, CheckpointMismatchError, ConfigError
from flax_loop.log import log


@dataclass
class OrbaxCheckpointReader:
    r"""A reader of the newest intact step of an Orbax checkpoint directory.

    As `CheckpointFileReader`, it goes where a model's `init` goes
    (`TrainLoop(init=OrbaxCheckpointReader(dir=..., target=model.init))`):
    the loop resumes from the newest step, restored straight into its own
    layout (any device count, any sharding), or starts afresh when the
    directory holds no checkpoint. A directory holding one Orbax checkpoint
    of parameters only (say, pretrained weights saved with
    `orbax.checkpoint.StandardCheckpointer`) starts training at step 0 from
    those parameters.
    """

    dir: str = None  # type: ignore[assignment]
    r"""a directory written by `OrbaxCheckpointWriter` (or holding parameters only)."""

    target: Any = None
    r"""the init function of the model the checkpoint belongs to."""

    output_dir: str | None = field(default=None, kw_only=True, repr=False)
    r"""`dir` as the writers spell it (either one is taken)."""

    def __post_init__(self) -> None:
        self.dir = one_directory(
            type(self).__name__, self.dir, self.output_dir, "dir", "output_dir"
        )
        self.output_dir = self.dir

    def __call__(self, initializer: CheckpointFile) -> CheckpointFile:
        r"""The newest step restored into `initializer`'s structure, or
        `initializer` itself when the directory holds no checkpoint."""
        restored = self.restore(initializer)
        return initializer if restored is None else restored

    def steps(self) -> list[int]:
        r"""The steps the directory holds, oldest first."""
        if not os.path.isdir(self.dir) or self._holds_parameters_only():
            return []
        with reading(self.dir) as manager:
            return sorted(manager.all_steps())

    def _holds_parameters_only(self) -> bool:
        return any(
            os.path.exists(os.path.join(self.dir, name))
            for name in ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt")
        )

    def restore(self, template: CheckpointFile) -> CheckpointFile | None:
        r"""The newest intact step restored into `template`'s structure.

        Args:
            template: the state at step 0 (arrays, or `jax.ShapeDtypeStruct` objects
                whose `sharding` says where each restored array goes; without
                one, it goes to the first local device).

        Returns:
            the state as `jax.Array` objects in the template's layout, or `None` when
            the directory holds no checkpoint. From a directory of parameters
            only, the file has `step=0` and no optimizer or model state.

        Raises:
            CheckpointMismatchError: if the checkpoint holds another model.
            CheckpointCorruptError: if steps exist but none can be read.
        """
        if not isinstance(template, CheckpointFile):
            raise ConfigError(
                f"Cannot restore a checkpoint from {self.dir!r}: the template must "
                f"be a CheckpointFile; got {type(template).__name__}."
            )
        if not os.path.isdir(self.dir):
            return None
        if self._holds_parameters_only():
            return self._restore_parameters(template)
        problems = []
        with reading(self.dir) as manager:
            for step in sorted(manager.all_steps(), reverse=True):
                where = os.path.join(self.dir, str(step))
                try:
                    with quiet_async_failures():
                        return self._restore_step(manager, step, template, where)
                except CheckpointMismatchError:
                    raise
                except Exception as error:
                    why = first_line(error)
                    problems.append(f"{where}: {why}")
                    log(
                        f"{where}: {why}",
                        lead="Skipped a damaged Orbax checkpoint:",
                        style="yellow",
                    )
        if problems:
            raise CheckpointCorruptError(
                f"Every checkpoint in {self.dir!r} is damaged, so none was loaded and "
                f"none was removed ({'; '.join(problems)}). Move them away to start afresh."
            )
        return None

    def _restore_step(
        self, manager: Any, step: int, template: CheckpointFile, where: str
    ) -> CheckpointFile:
        ocp = orbax_module()
        meta = decode_meta(
            manager.restore(step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[
                META_ITEM
            ],
            where,
        )
        if meta["step"] != step:
            raise CheckpointCorruptError(
                f"{where} is damaged or renamed: its folder says step {step}, its "
                f"metadata step {meta['step']}."
            )
        abstract = {part: abstract_tree(getattr(template, part)) for part in PARTS}
        index = manager.item_metadata(step)[STATE_ITEM]
        stored = getattr(index, "tree", index)
        carried = {name: tree for name, tree in template.carried.items() if tree is not None}
        held = set(stored) - set(PARTS) if isinstance(stored, dict) else set()
        check_held_as_saved(held, set(template.carried), where)
        for name in stored if isinstance(stored, dict) else ():
            # a field the step carried is restored: into the loop's layout when
            # the loop carries it too, else as stored (and then dropped)
            if name not in abstract:
                abstract[name] = abstract_tree(carried.get(name, stored[name]))
        check_compatible(index, abstract, where)
        state = restore_tree(
            manager.restore,
            where,
            abstract,
            step,
            args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract)}),
        )[STATE_ITEM]
        return CheckpointFile(
            **{name: state[name] for name in PARTS},
            carried={name: state[name] for name in state if name in carried},
            step=step,
            metrics=meta.get("metrics") or {},
            version=FORMAT_VERSION,
            rnkey=restore_key(meta, where),
            data_state=meta.get("data_state"),
            caller_state=meta.get("caller_state"),
            optimizer_names=_names(meta.get("optimizers")),
            path=where,
        )

    def _restore_parameters(self, template: CheckpointFile) -> CheckpointFile:
        ocp = orbax_module()
        abstract = abstract_tree(template.model_params)
        with ocp.StandardCheckpointer() as checkpointer:
            stored = checkpointer.metadata(os.path.abspath(self.dir))
            check_compatible(getattr(stored, "item_metadata", None), abstract, self.dir)
            params = restore_tree(
                checkpointer.restore, self.dir, abstract, os.path.abspath(self.dir), abstract
            )
        return CheckpointFile(
            model_params=params,
            model_state=None,
            optimizer_state=None,
            step=0,
            path=self.dir,
        )
