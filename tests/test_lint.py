"""The code style gates run with the suite: ruff (lint, format) and mypy."""

import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_clean(command):
    result = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr


# The import-layer contract (ARCHITECTURE.md, "Rooms"): layers from the
# bottom up, and inside a layer its modules in order. A module imports only
# from earlier modules of its layer or from lower layers, so imports point
# one way. `checkpoint` is one room: its modules import each other freely
# but nothing above the base layer.
LAYERS = {
    "base": [
        "errors", "_lazy", "version", "log", "random", "preemption", "parallel",
        "distributed", "throughput", "memory", "packing", "prefetch",
        "progress", "profiling",
    ],
    "checkpoint": ["checkpoint"],
    "models": ["batch", "model", "modules", "trainable", "objective", "task"],
    "data": ["source", "readahead", "feed"],
    "training": [
        "state", "sharding", "initial", "step", "lowering", "compiled", "interval",
        "runner", "assemble", "loop", "training",
    ],
    "evaluation": ["evaluation"],
    "output": [
        "console", "tensorboard", "jsonlines", "metric_store", "cli", "__main__", "__init__",
    ],
}  # fmt: skip
# Private checkpoint modules used outside the package, and why.
PRIVATE_IMPORTS = {
    # the digest of parameters a file leaves out is checked where the run's
    # initial state is assembled from the file and the model's init
    ("initial", "checkpoint._frozen"),
}


def imports_of(path):
    import ast

    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "flax_loop":
                yield from (alias.name for alias in node.names)
            elif node.module.startswith("flax_loop."):
                yield node.module.removeprefix("flax_loop.")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("flax_loop."):
                    yield alias.name.removeprefix("flax_loop.")


def test_imports_point_down_the_layers():
    import pathlib

    order = [name for layer in LAYERS.values() for name in layer]
    rank = {name: index for index, name in enumerate(order)}
    room = {name: 0 for name in rank}  # a room of several modules: checkpoint
    package = pathlib.Path(ROOT) / "flax_loop"
    modules = sorted(package.rglob("*.py"))
    wrong = []
    for path in modules:
        name = ".".join(path.relative_to(package).with_suffix("").parts)
        if name == "checkpoint.__init__":
            name = "checkpoint"
        home = name.split(".")[0]
        assert home in rank, f"flax_loop/{path.relative_to(package)} is in no layer of LAYERS"
        for imported in imports_of(path):
            target = imported.split(".")[0]
            if target not in rank:
                wrong.append(f"{name} imports {imported}, which is in no layer")
            elif home == target == "checkpoint":
                continue
            elif target == "checkpoint" and imported != "checkpoint":
                if (home, imported) not in PRIVATE_IMPORTS:
                    wrong.append(f"{name} imports the private {imported}")
            elif home == "__init__" or name == "flax_loop":
                continue  # the package's front door re-exports every room
            elif rank[target] >= rank[home] and room[target] == room[home] == 0:
                wrong.append(f"{name} imports {imported}, which is not below it")
    assert not wrong, "\n".join(wrong)
