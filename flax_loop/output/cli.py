r"""`flax-loop`: what is in a checkpoint directory, which file is good, which resumes.

    flax-loop ls DIR        a table of the checkpoints: step, file, size, time, status, resume
    flax-loop verify DIR    every checksum; exit 1 naming each damaged checkpoint, else 0
    flax-loop show PATH     a checkpoint's metadata and its arrays (bad ones marked)

(also `python -m flax_loop ...`). `ls` exits as `verify` does. Works on
directories of checkpoint files
and on Orbax directories written by `OrbaxCheckpointWriter`. A bad argument
prints the usage and exits with 2. `verify` names an Orbax step that an
interrupted write or pruning left incomplete; a resume skips such a step, so
it fails the check only when no intact step is left to resume from.

>>> import jax
>>> import optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop import TrainLoop, TrainTask, CheckpointFileWriter
>>> import pathlib, tempfile
>>> tmp = pathlib.Path(tempfile.mkdtemp())
>>> model = nn.Dense(3)
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
>>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
>>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0), n_steps=4,
...                  n_steps_per_checkpoint=3, stdout=False)
>>> with CheckpointFileWriter(output_dir=str(tmp / "ckpts"), keep=2) as writer:
...     for checkpoint in loop:
...         _ = writer(checkpoint)
>>> main(["verify", str(tmp / "ckpts")])
2 of 2 checkpoints in ... intact.
0
"""

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from flax_loop.checkpoint import CheckpointEntry, list_checkpoints, read_contents, read_damaged
from flax_loop.checkpoint.parse import read
from flax_loop.errors import CheckpointCorruptError, FlaxLoopError
from flax_loop.log import format_bytes

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2

# Tables keep a file's name and time on one line; piped output is 80 columns
# wide by default, too narrow for them.
_WIDTH = None if sys.stdout.isatty() else 120


def _version() -> str:
    r"""The installed package's version (its metadata: no import of the package's API)."""
    from importlib import metadata

    try:
        return metadata.version("flax_loop")
    except metadata.PackageNotFoundError:  # a source tree that is not installed
        return "(not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flax-loop", description="Inspect flax_loop checkpoint directories."
    )
    parser.add_argument("--version", action="version", version=f"flax-loop {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = commands.add_parser("ls", help="list a directory's checkpoints")
    ls.add_argument("dir", help="a checkpoint directory")
    verify = commands.add_parser(
        "verify", help="verify every checkpoint of a directory, or one checkpoint file"
    )
    verify.add_argument("dir", help="a checkpoint directory, or a checkpoint file")
    show = commands.add_parser("show", help="show one checkpoint's metadata and arrays")
    show.add_argument("path", help="a checkpoint file, or an Orbax step folder")
    return parser


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    r"""Runs the command line `argv` (default: `sys.argv[1:]`); its exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # argparse printed the usage and why
        return int(exit.code or 0)
    console = console or Console(highlight=False, soft_wrap=True, width=_WIDTH)
    try:
        if args.command == "ls":
            return _ls(args.dir, console)
        if args.command == "verify":
            return _verify(args.dir, console)
        return _show(args.path, console)
    except (FlaxLoopError, OSError) as error:
        console.print(f"flax-loop {args.command}: {error}", markup=False)
        return EXIT_USAGE


def _time(entry: CheckpointEntry) -> str:
    return datetime.datetime.fromtimestamp(entry.modified).strftime("%Y-%m-%d %H:%M")


_READERS = {
    "regular": "CheckpointFileReader",
    "lowest": "LowestCheckpointFileReader",
    "highest": "HighestCheckpointFileReader",
    "orbax": "OrbaxCheckpointReader",
}


def _problem(entry: CheckpointEntry) -> str:
    r"""Why an entry is not intact, naming it by its name (the directory is said once)."""
    problem = entry.problem.replace(entry.path, entry.name)
    return problem if entry.problem.startswith(entry.path) else f"{entry.name}: {problem}"


def _exit_status(entries: list[CheckpointEntry]) -> int:
    r"""1 if a checkpoint is damaged, or none a resume reads is intact; else 0.

    An incomplete Orbax step (pruning interrupted) harms nothing while the
    step a resume reads is intact."""
    bad = [entry for entry in entries if not entry.intact]
    damaged = [entry for entry in bad if entry.status != "incomplete"]
    resumes = any(entry.resume for entry in entries)
    return EXIT_DAMAGED if damaged or (bad and not resumes) else EXIT_OK


def _ls(directory: str, console: Console) -> int:
    entries = list_checkpoints(directory)
    if not entries:
        console.print(f"{directory}: no checkpoints.", markup=False)
        return EXIT_OK
    # The directory goes on its own line: a table's title wraps at the
    # table's width, which would split a long path where a user copies it.
    console.print(Text(directory), soft_wrap=True)
    # no borders: a directory of long names fits 80 columns without wrapping one
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("file", overflow="fold")  # a long name wraps, never loses its end
    for column in ("size", "written", ""):
        table.add_column(column, justify="right" if column == "size" else "left", no_wrap=True)
    for entry in entries:
        # the last column: the file a resume reads, or what is wrong with one
        note = (
            "<- resumes" if entry.resume else ("" if entry.intact else f"[red]{entry.status}[/red]")
        )
        table.add_row(
            f"{entry.step:,}",
            Text(entry.name + (" (Orbax step)" if entry.kind == "orbax" else "")),
            format_bytes(entry.size),
            _time(entry),
            note,
        )
    console.print(table)
    for entry in entries:
        if not entry.intact:
            console.print(f"{entry.status}: {_problem(entry)}", markup=False)
    # one line a reader: a line of them all wrapped mid-name at 80 columns
    for entry in entries:
        if entry.resume:
            reader = _READERS.get(entry.kind, entry.kind)
            console.print(f"<- resumes: {reader} reads {entry.name}.", markup=False)
    return _exit_status(entries)


def _verify(directory: str, console: Console) -> int:
    if os.path.isfile(directory):  # one file: read whole, every checksum checked
        try:
            read(directory)
        except CheckpointCorruptError as error:
            console.print(f"damaged: {error}", markup=False)
            return EXIT_DAMAGED
        console.print(f"{directory} intact.", markup=False)
        return EXIT_OK
    entries = list_checkpoints(directory)
    if not entries:  # nothing a resume could read: the check fails
        console.print(f"{directory} holds no checkpoint.", markup=False)
        return EXIT_DAMAGED
    bad = [entry for entry in entries if not entry.intact]
    for entry in bad:
        console.print(f"{entry.status}: {_problem(entry)}", markup=False)
    console.print(
        f"{len(entries) - len(bad)} of {len(entries)} checkpoints in {directory} intact.",
        markup=False,
    )
    return _exit_status(entries)


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    try:
        return json.dumps(value, default=repr)
    except (TypeError, ValueError):
        return repr(value)


def _show(path: str, console: Console) -> int:
    try:
        contents = read_contents(path)
    except CheckpointCorruptError:
        if os.path.isdir(path):
            raise
        contents = read_damaged(path)  # the metadata, and which arrays are bad
    console.print(f"{contents.path}", markup=False)
    console.print(f"  step: {contents.step}")
    console.print(f"  format version: {contents.version}")
    console.print(f"  run key stored: {'yes' if contents.has_rnkey else 'no'}")
    metrics = contents.metrics if isinstance(contents.metrics, dict) else {}
    console.print("  metrics:" + ("" if metrics else " none"))
    for group, values in metrics.items():  # one line a metric: none wraps at 80 columns
        shown = values.items() if isinstance(values, dict) else [("", values)]
        for name, value in shown:
            console.print(f"    {group}/{name}: {_value(value)}".replace("/:", ":"), markup=False)
    console.print(f"  data state: {_value(contents.data_state)}", markup=False)
    if contents.left_out:
        console.print(
            f"  frozen parameters left out (a resume takes them from its init): "
            f"{', '.join(contents.left_out)}",
            markup=False,
        )
    table = Table(title=f"{len(contents.arrays)} arrays", title_justify="left")
    for column in ("path", "shape", "dtype", "bytes"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    if contents.damaged:
        table.add_column("status")
    for key, shape, dtype, nbytes in contents.arrays:
        row: list[Any] = [Text(key), str(shape), dtype, format_bytes(nbytes)]
        if contents.damaged:
            row.append("[red]damaged[/red]" if key in contents.damaged else "intact")
        table.add_row(*row)
    total = sum(nbytes for *_, nbytes in contents.arrays)
    table.add_row("total", "", "", format_bytes(total))
    console.print(table)
    for problem in contents.damaged.values():
        console.print(f"damaged: {problem}", markup=False)
    return EXIT_DAMAGED if contents.damaged else EXIT_OK


def run() -> None:  # pragma: no cover - the console script
    r"""The `flax-loop` console script."""
    sys.exit(main())
