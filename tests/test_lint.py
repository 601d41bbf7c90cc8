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


# The import-layer contract, stated once in ARCHITECTURE.md ("Layers", which
# `test_the_contract_is_the_architectures` holds this to): layers from the
# bottom up, and inside a layer its rooms in order. A room is a top-level
# module or a package (`checkpoint`, `data`, `distributed`, `step`, `programs`, `run`,
# `output`), whose
# modules import each other freely. A module imports only from earlier
# rooms, never another package's private module, and never in a cycle.
LAYERS = {
    "base": ["errors", "_lazy", "log", "random", "parallel", "distributed"],
    "checkpoint": ["checkpoint"],
    "data": ["data"],
    "step": ["step", "programs"],
    "task": ["task"],
    "run": ["run"],
    "front": ["loop", "training", "evaluation"],
    "output": ["output", "__main__", "__init__"],
}
PACKAGES = {"checkpoint", "data", "distributed", "step", "programs", "run", "output"}


def module_names():
    import pathlib

    package = pathlib.Path(ROOT) / "flax_loop"
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        yield ".".join(parts), path


def imports_of(path):
    """What a module imports: import statements at any depth (in functions
    too), and the modules a lazy-name table (`_HOMES`, `offer(...)`) names."""
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
        elif isinstance(node, ast.Dict):
            for value in node.values:
                if isinstance(value, ast.Constant) and str(value.value).startswith("flax_loop."):
                    yield str(value.value).removeprefix("flax_loop.")


def test_imports_point_down_the_layers():
    order = [room for rooms in LAYERS.values() for room in rooms]
    rank = {room: index for index, room in enumerate(order)}
    wrong = []
    for name, path in module_names():
        home = name.split(".")[0]
        assert home in rank, f"flax_loop/{name} is in no layer of LAYERS"
        for imported in imports_of(path):
            target = imported.split(".")[0]
            private = any(part.startswith("_") for part in imported.split(".")[1:])
            if target not in rank:
                wrong.append(f"{name} imports {imported}, which is in no layer")
            elif private and target != home:
                wrong.append(f"{name} imports the private {imported}")
            elif home == "__init__" or home == target:
                continue  # the front door re-exports every room; a room is one place
            elif rank[target] >= rank[home]:
                wrong.append(f"{name} imports {imported}, which is not below it")
    assert not wrong, "\n".join(wrong)


DOORS = {"task", "evaluation", "step/several", "step/modules", "step/frozen"}
r"""Where a model (the task's, an evaluation's, `init`'s, a frozen one) is
asked whether it is NNX or several; everywhere else reads `ModelKind`."""


def test_the_models_kind_is_asked_at_the_doors_only():
    import re

    asking = re.compile(r"\b(is_nnx|is_several)\(")
    askers = {
        name.replace(".", "/")
        for name, path in module_names()
        if any(asking.search(line) and "def " not in line for line in open(path))
    }
    assert askers <= DOORS, sorted(askers - DOORS)


def test_no_import_runs_in_a_cycle():
    graph = {}
    for name, path in module_names():
        graph[name] = set()
        for imported in imports_of(path):
            parts = imported.split(".")
            # `from flax_loop.step import core` names a module, not the package
            graph[name].add(imported)
            graph[name].add(".".join(parts[:-1]) if len(parts) > 1 else imported)
    known = set(graph)
    graph = {
        name: {t for t in targets if t in known and t != name} for name, targets in graph.items()
    }
    # a package's __init__ is its front door: its lazy table and re-exports
    # resolve when a name is first used, after its modules are loaded
    front = {name for name in graph if name in PACKAGES or name == "__init__"}
    cycles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for target in sorted(graph[node]):
            if target in front:
                continue
            if state.get(target) == "open":
                cycles.append(" -> ".join(trail[trail.index(target) :] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_the_contract_is_the_architectures():
    import re

    text = open(f"{ROOT}/ARCHITECTURE.md").read()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `?(\w+)`? \| ([^|]+) \|", section, re.M)
    stated = {
        layer: [room.strip().strip("`/") for room in rooms.split(",")]
        for layer, rooms in rows
        if layer != "layer"
    }
    assert stated == LAYERS


def test_at_most_twelve_modules_at_the_top():
    import pathlib

    top = sorted(p.name for p in (pathlib.Path(ROOT) / "flax_loop").glob("*.py"))
    assert len(top) <= 12, top
