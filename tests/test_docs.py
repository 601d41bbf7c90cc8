"""Every `>>>` example in the package's docstrings, and README.md's and the
guides' code, runs in the suite: documentation that cannot rot.

Each docstring example stands alone (its imports, a small model and its
data are in the example, as optax's and flax's are): it is given only its
module's names.
"""

import doctest
import importlib
import io
import os
import pkgutil
import re
import subprocess
import sys

import pytest
from rich.console import Console

import flax_loop
from flax_loop import set_console
from tests.flags import xla_flags
from tests.helpers import ROOT, digits_split

X_TRAIN, Y_TRAIN, X_TEST, Y_TEST = digits_split()
MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(flax_loop.__path__, "flax_loop.")
    if not name.endswith("__main__")
)


def docstring_examples():
    finder = doctest.DocTestFinder(exclude_empty=True)
    for name in MODULES:
        module = importlib.import_module(name)
        for test in finder.find(module, name, globs={}):
            if test.examples and test.name.startswith(name):
                yield pytest.param(module, test, id=test.name)


@pytest.mark.parametrize("module, test", list(docstring_examples()))
def test_docstring_example(module, test):
    # Each example stands alone, as `pytest --doctest-modules --pyargs
    # flax_loop` runs it: its module's names and its own imports, nothing else.
    test.globs = dict(vars(module))
    # the console a reader's run has: what it prints is part of the example
    # (the doctest runner reads stdout, where the default console writes)
    set_console(None)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    output = io.StringIO()
    result = runner.run(test, out=output.write)
    assert result.failed == 0, output.getvalue()
    assert result.attempted == len(test.examples)


def test_every_public_module_has_examples():
    with_examples = {
        param.values[0].__name__.removeprefix("flax_loop.") for param in docstring_examples()
    }
    for room in (
        "loop", "data.feed", "step.core", "step.ema", "step.nonfinite", "programs.statistics",
        "run.initial", "checkpoint._checkpoint", "evaluation", "random", "data.batch",
    ):  # fmt: skip
        assert room in with_examples, room


def readme_section(title):
    text = open(os.path.join(ROOT, "README.md")).read()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_program_runs_as_pasted_twice_and_prints_what_it_shows(tmp_path):
    # As a reader runs it: the block alone in a file, a fresh process on the
    # one CPU device a reader has, then again in the same directory.
    section = readme_section("A complete program")
    program, shown = re.findall(r"```(?:python)?\n(.*?)```", section, flags=re.DOTALL)
    (tmp_path / "train.py").write_text(program)
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}  # one device, the suite's compile flags
    env["JAX_PLATFORMS"] = "cpu"

    def run():
        result = subprocess.run(
            [sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True,
            timeout=300, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    def without_timings(text):
        text = re.sub(r"\d+\.\d+ s", "_ s", text)
        return re.sub(r" \(_ s of it compiling\)", "", text)

    first = run()
    printed = [without_timings(line) for line in first.splitlines() if line.startswith("Step ")]
    expected = [without_timings(line) for line in shown.splitlines() if line.startswith("Step ")]
    assert printed == expected  # the losses and accuracies README shows, bit for bit
    assert "on 1 device" in first and "Done: 2,000 steps" in first
    files = sorted(name for name in os.listdir(tmp_path / "ckpts") if name.endswith(".ckpt"))
    assert files == ["regular.1500.ckpt", "regular.2000.ckpt"]
    second = run()
    assert "Resumed from step 2,000" in second and "Nothing to train" in second
    assert "Step " not in second and "Traceback" not in second


def test_the_beyond_supervised_guide_runs_as_written(capsys):
    # every python block of the guide is a complete program
    text = open(os.path.join(ROOT, "docs", "guides", "beyond_supervised.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 5
    for block in blocks:
        exec(compile(block, "beyond_supervised.md", "exec"), {"__name__": "guide"})
    printed = capsys.readouterr().out
    assert "['discriminator', 'generator']" in printed


# Guides whose programs resume from the files they write: a reader runs
# them as programs, and again; each runs so, twice, in a fresh process.
# (The other guides that write files start them afresh, or resume within
# the program, as Checkpoints does: they run once, below.)
GUIDES_RUN_TWICE = ("getting_started.md", "checkpoints.md")

# Guides whose programs another test runs, with assertions of its own.
GUIDES_RUN_ELSEWHERE = {
    "beyond_supervised.md": "test_the_beyond_supervised_guide_runs_as_written",
    "time_and_memory.md": "test_the_time_and_memory_guide_runs_as_written",
    "migrating.md": "tests/test_compat.py",
    "from_keras.md": "tests/test_porting.py",  # Keras's JAX backend, in a process of its own
    **{name: "test_a_guide_that_resumes_runs_twice_as_a_program" for name in GUIDES_RUN_TWICE},
}

CONTINUES = "# continues the block above"


def undefined_names(block):
    """The names a block uses that it neither defines nor imports (nor are builtins)."""
    import builtins
    import symtable

    top = symtable.symtable(block, "block", "exec")
    bound = {
        symbol.get_name()
        for symbol in top.get_symbols()
        if symbol.is_assigned() or symbol.is_imported() or symbol.is_namespace()
    }
    used = set()

    def walk(table):
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table is top or symbol.is_global()):
                used.add(symbol.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return sorted(name for name in used - bound if not hasattr(builtins, name))


def test_every_guide_block_runs_alone_or_says_it_continues():
    # a block pasted alone runs, or its first line says it continues the one above
    folder = os.path.join(ROOT, "docs", "guides")
    for name in sorted(os.listdir(folder)):
        text = open(os.path.join(folder, name)).read()
        for index, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
            missing = undefined_names(block)
            assert not missing or block.startswith(CONTINUES), (
                f"{name}, block {index + 1} uses {missing} without defining them: "
                f"make it whole, or begin it with {CONTINUES!r}"
            )
    assert undefined_names("import os\nprint(os.sep, x)\ndef f():\n    return y") == ["x", "y"]


@pytest.mark.parametrize("guide", GUIDES_RUN_TWICE)
def test_a_guide_that_resumes_runs_twice_as_a_program(guide, tmp_path):
    # the guide's blocks as one program, run in a fresh process on one CPU
    # device, then again in the same directory (its files there)
    text = open(os.path.join(ROOT, "docs", "guides", guide)).read()
    (tmp_path / "guide.py").write_text("\n".join(re.findall(r"```python\n(.*?)```", text, re.S)))
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}  # one device, the suite's compile flags
    env["JAX_PLATFORMS"] = "cpu"
    stops = []
    for run in ("first", "second"):
        result = subprocess.run(
            [sys.executable, "guide.py"], cwd=tmp_path, capture_output=True, text=True,
            timeout=300, env=env,
        )  # fmt: skip
        assert result.returncode == 0, f"the {run} run: {result.stderr[-3000:]}"
        assert "Traceback" not in result.stdout
        stops.append([line for line in result.stdout.splitlines() if "stopped at step" in line])
    assert stops[0] == stops[1]  # an early stop stops where it did (its best not an earlier run's)


def guides_with_programs():
    folder = os.path.join(ROOT, "docs", "guides")
    for name in sorted(os.listdir(folder)):
        text = open(os.path.join(folder, name)).read()
        if "```python" in text and name not in GUIDES_RUN_ELSEWHERE:
            yield name


# Guides about several devices: run on the suite's four.
SEVERAL_DEVICES = {"devices.md", "whole_batch.md"}


@pytest.mark.parametrize("guide", list(guides_with_programs()))
def test_a_guide_runs_as_written(guide, tmp_path, monkeypatch, capsys, request):
    # A guide's python blocks run one after the other, in one namespace, in
    # a fresh directory: each guide stands alone, its imports and model in it.
    if guide not in SEVERAL_DEVICES:
        request.getfixturevalue("one_device")
    text = open(os.path.join(ROOT, "docs", "guides", guide)).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    monkeypatch.chdir(tmp_path)
    set_console(Console(file=io.StringIO()))
    namespace = {"__name__": "guide"}
    environment = dict(os.environ)  # what a guide sets (WANDB_MODE) ends with it
    try:
        for index, block in enumerate(blocks):
            exec(compile(block, f"{guide}, block {index + 1}", "exec"), namespace)
    finally:
        for name in set(os.environ) - set(environment):
            del os.environ[name]
        os.environ.update(environment)
    assert "Traceback" not in capsys.readouterr().out


def test_the_time_and_memory_guide_runs_as_written(capsys):
    text = open(os.path.join(ROOT, "docs", "guides", "time_and_memory.md")).read()
    (block,) = re.findall(r"```python\n(.*?)```", text, re.S)
    exec(compile(block, "time_and_memory.md", "exec"), {"__name__": "guide"})
    printed = capsys.readouterr().out
    assert "bytes a device" in printed and "\n40 " in printed
    assert "data " in printed and "your code " in printed


def test_every_readme_python_block_is_valid_python():
    import ast

    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        tree = ast.parse(block)  # a SyntaxError names the block's line
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        # a module a block calls into is imported in that block
        for module in ("os", "PartitionSpec", "functools"):
            if module in used:
                assert re.search(rf"^(from \S+ )?import .*\b{module}\b", block, re.M), block


def test_the_version_is_the_changelogs_newest():
    # "## Unreleased (0.3.0)" is 0.3.0.dev0 until released; a release heading is the version
    with open(os.path.join(ROOT, "CHANGELOG.md")) as changelog:
        heading = next(line.strip() for line in changelog if line.startswith("## "))
    released = re.fullmatch(r"## (\d+\.\d+\.\d+)", heading)
    unreleased = re.fullmatch(r"## Unreleased \((\d+\.\d+\.\d+)\)", heading)
    assert released or unreleased, heading
    expected = released[1] if released else unreleased[1] + ".dev0"  # type: ignore[index]
    assert flax_loop.__version__ == expected
