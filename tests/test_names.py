"""One spelling of a directory for readers and writers (the other an alias,
as flax-extra's programs use both), and `stdout` on every writer."""

import os

import pytest

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
    HighestCheckpointFileReader,
    HighestCheckpointFileWriter,
    OrbaxCheckpointReader,
    OrbaxCheckpointWriter,
    set_console,
)
from flax_loop.errors import ConfigError
from tests.helpers import MLP, digits_split, hand_trained

X, Y, _, _ = digits_split()


def test_readers_and_writers_take_either_spelling_of_the_directory(tmp_path):
    where = str(tmp_path)
    for writer in (
        CheckpointFileWriter(dir=where),
        CheckpointFileWriter(output_dir=where),
        OrbaxCheckpointWriter(dir=where),
        HighestCheckpointFileWriter(metric="accuracy", dir=where, stdout=False),
    ):
        assert writer.output_dir == writer.dir == where
    for reader in (
        CheckpointFileReader(dir=where, target=None),
        CheckpointFileReader(output_dir=where, target=None),
        CheckpointFileReader(where, None),  # flax-extra's positional order
        OrbaxCheckpointReader(output_dir=where, target=None),
        HighestCheckpointFileReader(output_dir=where, metric="accuracy"),
    ):
        assert reader.dir == reader.output_dir == where
    with pytest.raises(ConfigError, match=r"output_dir='a' and dir='b': give the directory once"):
        CheckpointFileWriter(output_dir="a", dir="b")
    with pytest.raises(ConfigError, match="CheckpointFileReader needs dir"):
        CheckpointFileReader(target=None)
    with pytest.raises(ConfigError, match="metric must be a non-empty string"):
        HighestCheckpointFileReader(dir=where)


def test_a_writer_says_what_it_removes_unless_stdout_is_off(tmp_path):
    import io

    from rich.console import Console

    model = MLP(features=(8,))
    longer, shorter = hand_trained(4, 2, model), hand_trained(2, 2, model)
    for stdout in (True, False):
        directory = str(tmp_path / str(stdout))
        with CheckpointFileWriter(output_dir=directory, keep=3) as write:
            for checkpoint in longer:
                write(checkpoint)
        out = io.StringIO()
        set_console(Console(file=out, width=200))
        try:  # a shorter run written over the longer one's files
            with CheckpointFileWriter(dir=directory, overwrite=True, stdout=stdout) as write:
                write(shorter[-1])
        finally:
            set_console(None)
        said = "removing 1 file(s) of steps [4] an earlier run left" in out.getvalue()
        assert said is stdout, out.getvalue()
        assert sorted(n for n in os.listdir(directory) if n.endswith(".ckpt")) == ["regular.2.ckpt"]


def test_the_tensorboard_writer_says_once_how_to_see_its_events_unless_stdout_is_off(tmp_path):
    import io

    from rich.console import Console

    from flax_loop import SummaryWriter

    pytest.importorskip("tensorboardX")
    (summary,) = hand_trained(1, 1, MLP(features=(8,)))
    for stdout in (True, False):
        out = io.StringIO()
        set_console(Console(file=out, width=200))
        try:
            with SummaryWriter(str(tmp_path / str(stdout)), stdout=stdout) as write:
                write(summary)
                write(summary)
        finally:
            set_console(None)
        said = out.getvalue().count(f"tensorboard --logdir {tmp_path / str(stdout)}")
        assert said == (1 if stdout else 0), out.getvalue()


def test_a_json_lines_writer_says_when_it_appends_to_an_earlier_run(tmp_path):
    import io

    from rich.console import Console

    from flax_loop import JsonLinesWriter

    checkpoints = hand_trained(2, 1, MLP(features=(8,)))
    path = str(tmp_path / "metrics.jsonl")
    said = []
    for stdout in (True, True, False):
        out = io.StringIO()
        set_console(Console(file=out, width=200))
        try:
            with JsonLinesWriter(path, stdout=stdout) as write:
                for checkpoint in checkpoints:
                    write(checkpoint)
        finally:
            set_console(None)
        said.append(out.getvalue())
    assert said[0] == ""  # a new file
    assert (
        "appending to" in said[1]
        and "holds 2 lines of an earlier run, the last of step 2" in said[1]
    )
    assert said[2] == ""  # stdout=False
