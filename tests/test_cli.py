"""The checkpoint inspector: `flax-loop ls`, `verify`, `show` on good and bad directories."""

import io
import os
import re
import shutil
import subprocess
import sys

import pytest
from rich.console import Console

from flax_loop import CheckpointFileWriter, HighestCheckpointFileWriter, OrbaxCheckpointWriter
from flax_loop.checkpoint import Summary, list_checkpoints
from flax_loop.output.cli import main
from tests.helpers import ROOT, hand_trained


@pytest.fixture(scope="module")
def checkpoints():
    return hand_trained(6, 2)


def flip_a_byte(path, offset=200):
    with open(path, "r+b") as stream:
        stream.seek(offset)
        byte = stream.read(1)
        stream.seek(offset)
        stream.write(bytes([byte[0] ^ 0xFF]))


def inspect(*argv, width=100):
    """(exit status, output) of the command line, in a terminal 100 columns wide."""
    output = io.StringIO()
    status = main(list(map(str, argv)), console=Console(file=output, width=width))
    assert "…" not in output.getvalue(), output.getvalue()  # nothing cut short
    return status, " ".join(output.getvalue().replace("│", " ").split())  # no cell borders


@pytest.fixture
def files(tmp_path, checkpoints):
    """regular 2 (intact), 4 (damaged), 6 (intact), 8 (unreadable); a best file."""
    with CheckpointFileWriter(output_dir=str(tmp_path), keep=3) as writer:
        for checkpoint in checkpoints:
            writer(checkpoint)
    last = checkpoints[-1]
    summary = Summary(**{**last.__dict__, "metrics": {"eval": {"accuracy": 0.5}}})
    with HighestCheckpointFileWriter(
        metric="accuracy", output_dir=str(tmp_path), stdout=False
    ) as writer:
        writer(summary)
    flip_a_byte(tmp_path / "regular.4.ckpt")
    os.mkdir(tmp_path / "regular.8.ckpt")  # the system refuses to read it as a file
    return tmp_path


def test_ls_prints_a_long_directory_whole_on_its_own_line(tmp_path, checkpoints):
    directory = tmp_path / ("a-long-run-name-" * 8) / "seed-0"
    with CheckpointFileWriter(output_dir=str(directory)) as writer:
        writer(checkpoints[0])
    output = io.StringIO()
    status = main(["ls", str(directory)], console=Console(file=output, width=100))
    assert status == 0 and len(str(directory)) > 100
    assert output.getvalue().splitlines()[0] == str(directory)


def test_ls_fits_80_columns_with_each_file_name_whole(files):
    output = io.StringIO()
    main(["ls", str(files)], console=Console(file=output, width=80))
    lines = output.getvalue().splitlines()
    table = [line for line in lines if re.match(r"\s*(step|[\d,]+)\s", line)]  # its rows
    assert len(table) == 6  # the header and five checkpoints
    assert all(len(line.rstrip()) <= 80 for line in table), table
    for name in ("regular.2.ckpt", "regular.8.ckpt", "highest.eval.accuracy.6.ckpt"):
        assert any(name in line for line in table), (name, table)


def test_ls_lists_steps_files_status_and_the_file_each_resume_reads(files):
    status, out = inspect("ls", files)
    assert status == 1  # as verify: a damaged file
    for name in ("regular.2.ckpt", "regular.4.ckpt", "regular.6.ckpt", "regular.8.ckpt"):
        assert name in out
    assert "6 highest.eval.accuracy.6.ckpt" in out
    assert (
        "damaged: regular.4.ckpt is damaged: array model_params/Dense_0/bias (float32 (64,)) "
        "fails its checksum." in out
    )
    assert str(files / "regular.4.ckpt") not in out  # the directory is said once
    assert "unreadable: regular.8.ckpt: [Errno 21] Is a directory: 'regular.8.ckpt'" in out
    entries = {entry.name: entry for entry in list_checkpoints(str(files))}
    assert entries["regular.2.ckpt"].status == "intact"
    assert entries["regular.4.ckpt"].status == "damaged"
    assert entries["regular.8.ckpt"].status == "unreadable"
    # The newest intact file is the one a resume reads, not the unreadable 8.
    assert [name for name, entry in entries.items() if entry.resume] == [
        "highest.eval.accuracy.6.ckpt",
        "regular.6.ckpt",
    ]
    assert out.count("<- resumes") == 4  # two rows, and a line for each saying what it means
    assert "<- resumes: HighestCheckpointFileReader reads highest.eval.accuracy.6.ckpt." in out
    assert "<- resumes: CheckpointFileReader reads regular.6.ckpt." in out


def test_verify_exits_1_naming_each_bad_file_and_0_when_all_are_intact(files):
    status, out = inspect("verify", files)
    assert status == 1
    assert "damaged: " in out and "regular.4.ckpt" in out and "unreadable: " in out
    assert "3 of 5 checkpoints" in out and "intact" in out
    os.remove(files / "regular.4.ckpt")
    os.rmdir(files / "regular.8.ckpt")
    assert inspect("verify", files) == (0, f"3 of 3 checkpoints in {files} intact.")


def test_show_prints_metadata_and_every_array(files):
    status, out = inspect("show", files / "regular.6.ckpt")
    assert status == 0
    assert "step: 6" in out and "format version: 1" in out and "run key stored: yes" in out
    assert "model_params/Dense_0/kernel (64, 64) float32 16.0 KiB" in out
    assert "optimizer_state/0/mu/Dense_0/kernel (64, 64) float32" in out  # Adam's moments
    status, out = inspect("show", files / "highest.eval.accuracy.6.ckpt")
    assert "metrics: eval/accuracy: 0.5" in out


def test_show_on_a_damaged_file_prints_its_metadata_and_marks_the_bad_array(files):
    status, out = inspect("show", files / "regular.4.ckpt")
    assert status == 1 and "Traceback" not in out
    assert "step: 4" in out and "run key stored: yes" in out
    assert "model_params/Dense_0/bias (64,) float32 256 B damaged" in out
    assert "model_params/Dense_0/kernel (64, 64) float32 16.0 KiB intact" in out
    assert out.endswith(
        "damaged: array model_params/Dense_0/bias (float32 (64,)) fails its checksum."
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required"),
        (["list", "x"], "invalid choice: 'list'"),
        (["ls"], "the following arguments are required: dir"),
        (["ls", "/no/such/directory"], "'/no/such/directory' is not a directory"),
        (["show", "/no/such/file.ckpt"], "No such file or directory"),
    ],
    ids=["nothing", "unknown-command", "no-directory", "missing-directory", "missing-file"],
)
def test_bad_arguments_print_usage_or_why_and_exit_2(argv, message, capsys):
    status, out = inspect(*argv)
    err = " ".join(capsys.readouterr().err.split())
    assert status == 2
    assert message in out + err and "Traceback" not in out + err


# Orbax's failed restore of the damaged step below leaves callbacks of its
# reads to an event loop it has closed (RuntimeError "Event loop is closed",
# raised in Orbax's threads and reported by the garbage collector).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_orbax_directories_too(tmp_path, checkpoints):
    with OrbaxCheckpointWriter(output_dir=str(tmp_path), keep=3) as writer:
        for checkpoint in checkpoints:
            writer(checkpoint)
    status, out = inspect("ls", tmp_path)
    assert status == 0 and out.count("(Orbax step)") == 3 and out.count("<- resumes") == 2
    assert "<- resumes: OrbaxCheckpointReader reads 6." in out
    assert [entry.resume for entry in list_checkpoints(str(tmp_path))] == [False, False, True]
    status, out = inspect("show", tmp_path / "6")
    assert "step: 6" in out and "model_params/Dense_0/kernel (64, 64) float32" in out
    shutil.rmtree(tmp_path / "4" / "state" / "d")  # its array data
    status, out = inspect("verify", tmp_path)
    assert status == 1 and "damaged: 4: " in out
    assert "2 of 3 checkpoints" in out


def test_the_module_and_console_script_run(files):
    result = subprocess.run(
        [sys.executable, "-m", "flax_loop", "verify", str(files)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "regular.4.ckpt" in result.stdout
    script = shutil.which("flax-loop")
    if script is not None:  # installed with pip install -e .
        assert subprocess.run([script, "ls", str(files)], capture_output=True).returncode == 1


def test_listing_files_loads_neither_jax_nor_orbax(files):
    program = (
        "import sys\n"
        "from flax_loop.output import cli\n"
        "codes = [cli.main(args) for args in sys.argv[1:] and "
        "[['ls', sys.argv[1]], ['verify', sys.argv[1]], ['show', sys.argv[2]]]]\n"
        "print(codes, sorted(m for m in ('jax', 'orbax', 'flax') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program, str(files), str(files / "regular.6.ckpt")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # ls and verify find the damaged file (1), show reads an intact one (0)
    assert result.stdout.strip().endswith("[1, 1, 0] []"), result.stdout + result.stderr


def test_version_and_verify_of_one_file(files, capsys):
    import flax_loop

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"flax-loop {flax_loop.__version__}"
    status, out = inspect("verify", files / "regular.6.ckpt")
    assert status == 0 and "regular.6.ckpt intact." in out
    status, out = inspect("verify", files / "regular.4.ckpt")  # a flipped byte
    assert status == 1 and out.startswith("damaged: ") and "Traceback" not in out


def test_verify_names_what_stands_where_a_directory_or_file_was_expected(tmp_path, checkpoints):
    """A folder named like a file holds no checkpoint (exit 1); nothing, a
    FIFO or a looping link is named as what it is; a looping link among good
    files is reported as damaged, and a resume reads the newest intact one."""
    from flax_loop import CheckpointFileReader

    (tmp_path / "named" / "regular.6.ckpt").mkdir(parents=True)
    status, out = inspect("verify", tmp_path / "named" / "regular.6.ckpt")
    assert status == 1 and "holds no checkpoint" in out
    os.mkfifo(tmp_path / "fifo")
    os.symlink("l2", tmp_path / "l1")
    os.symlink("l1", tmp_path / "l2")
    for name, what in (("nothing", "nothing is there"), ("fifo", "mode prw"),
                       ("l1", "a symbolic link that loops")):  # fmt: skip
        status, out = inspect("verify", tmp_path / name)
        assert status == 2 and "is not a directory: " in out and what in out
    good = tmp_path / "good"
    with CheckpointFileWriter(output_dir=str(good), keep=5) as writer:
        for checkpoint in checkpoints:
            writer(checkpoint)
    os.symlink("loop", good / "regular.99.ckpt")
    os.symlink("regular.99.ckpt", good / "loop")
    status, out = inspect("verify", good)
    assert status == 1 and "regular.99.ckpt is not a checkpoint: a symbolic link that loops" in out
    assert f"{len(checkpoints)} of {len(checkpoints) + 1} checkpoints" in out
    newest = CheckpointFileReader(dir=str(good), target=None).read_newest()
    assert newest.step == checkpoints[-1].step


def test_ls_and_show_fit_80_columns_a_line_each(tmp_path, checkpoints):
    """No line of `ls` or `show` is wider than 80 columns with many metrics
    and two readers (one line a metric, one line a reader), so none wraps
    mid-word."""
    from flax_loop import HighestCheckpointFileWriter

    last = checkpoints[-1]
    metrics = {"eval": {f"metric_number_{index}": 0.5 + index for index in range(8)}}
    with HighestCheckpointFileWriter(
        metric="metric_number_0", output_dir=str(tmp_path), stdout=False
    ) as write:
        write(Summary(**{**last.__dict__, "metrics": metrics}))
    with CheckpointFileWriter(output_dir=str(tmp_path), stdout=False) as write:
        write(last)
    for argv in (("ls", tmp_path), ("show", tmp_path / f"regular.{last.step}.ckpt"),
                 ("show", next(tmp_path.glob("highest.*")))):  # fmt: skip
        output = io.StringIO()
        main(list(map(str, argv)), console=Console(file=output, width=80))
        lines = [line.strip() for line in output.getvalue().splitlines()]
        assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
        if argv[0] == "ls":  # each reader's line whole, none folded into the next
            assert f"<- resumes: CheckpointFileReader reads regular.{last.step}.ckpt." in lines
            assert sum(line.startswith("<- resumes: ") for line in lines) == 2
        elif "highest" in str(argv[1]):
            assert "eval/metric_number_7: 7.5" in lines  # one line a metric
