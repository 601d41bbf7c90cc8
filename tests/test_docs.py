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

import pytest
from rich.console import Console

import flax_loop
from flax_loop import set_console
from tests.helpers import MLP, ROOT, accuracy, batches, cross_entropy, digits_split

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
    set_console(Console(file=io.StringIO()))  # messages are not part of the examples
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
        "loop", "data.feed", "step.core", "step.ema", "step.nonfinite", "step.statistics",
        "run.initial", "checkpoint._checkpoint", "evaluation", "random", "data.batch",
    ):  # fmt: skip
        assert room in with_examples, room


def readme_use_section():
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## Use", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert blocks, "README.md's Use section has no python example"
    return blocks


def test_readme_use_section_runs(tmp_path, monkeypatch, one_device):
    monkeypatch.chdir(tmp_path)
    set_console(Console(file=io.StringIO()))
    model = MLP(features=(32,))
    namespace = {
        "model": model,
        "cross_entropy": cross_entropy,
        "accuracy": accuracy,
        "train_batches": batches(X_TRAIN, Y_TRAIN, 32),
        "test_batches": [(X_TEST[i : i + 100], Y_TEST[i : i + 100]) for i in range(0, 300, 100)],
    }
    for block in readme_use_section():
        exec(compile(block, "README.md", "exec"), namespace)
    loop = namespace["loop"]
    assert loop.step == loop.n_steps
    assert len(loop.devices) == 1  # as on a reader's CPU (the one_device fixture holds)
    assert {name for name in os.listdir("ckpts") if name.endswith(".ckpt")} == {
        f"regular.{loop.n_steps - loop.n_steps_per_checkpoint}.ckpt",
        f"regular.{loop.n_steps}.ckpt",
    }


def test_the_beyond_supervised_guide_runs_as_written(capsys):
    # every python block of the guide is a complete program
    text = open(os.path.join(ROOT, "docs", "guides", "beyond_supervised.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 5
    for block in blocks:
        exec(compile(block, "beyond_supervised.md", "exec"), {"__name__": "guide"})
    printed = capsys.readouterr().out
    assert "['discriminator', 'generator']" in printed


# Guides whose programs another test runs, with assertions of its own.
GUIDES_RUN_ELSEWHERE = {
    "beyond_supervised.md": "test_the_beyond_supervised_guide_runs_as_written",
    "time_and_memory.md": "test_the_time_and_memory_guide_runs_as_written",
    "migrating.md": "tests/test_compat.py",
}


def guides_with_programs():
    folder = os.path.join(ROOT, "docs", "guides")
    for name in sorted(os.listdir(folder)):
        text = open(os.path.join(folder, name)).read()
        if "```python" in text and name not in GUIDES_RUN_ELSEWHERE:
            yield name


# Guides about several devices: run on the suite's four.
SEVERAL_DEVICES = {"devices.md"}


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
    for index, block in enumerate(blocks):
        exec(compile(block, f"{guide}, block {index + 1}", "exec"), namespace)
    assert "Traceback" not in capsys.readouterr().out


def test_the_readme_time_and_memory_block_runs(capsys):
    text = open(os.path.join(ROOT, "README.md")).read()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "memory_plan" in b]
    namespace = {"__name__": "readme"}
    exec(compile(block, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert " bytes a device" in printed and "'caller'" in printed and "'setup'" in printed
    assert namespace["loop"].step == 20


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
    assert len(blocks) >= 7
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
