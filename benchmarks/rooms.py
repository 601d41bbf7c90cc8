"""How many test functions build a whole loop: the suite's shape, not a timing.

A test function counts when it, a function of its module or of
tests/helpers.py it calls, or a fixture it takes (transitively) constructs a
`TrainLoop` or starts a process (`subprocess`, `Popen`, a pseudo-terminal).
The rest test a room alone (the step's forms as plain JAX, the plan, the
feed's stages, the file format, writers and readers on hand-made
checkpoints). Read from the source with `ast`; nothing is run.

    python benchmarks/rooms.py [--by-module] [ROOT]
"""

import argparse
import ast
import pathlib

MARKS = {"TrainLoop", "Popen", "subprocess", "run_program", "spawn", "pexpect", "pty"}
SHARED = ("helpers", "conftest")


def called(node):
    """The bare names a function calls, and any mark it names."""
    names = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Call):
            function = child.func
            if isinstance(function, ast.Name):
                names.add(function.id)
            elif isinstance(function, ast.Attribute) and function.attr in MARKS:
                names.add(function.attr)
        elif isinstance(child, ast.Name) and child.id in MARKS:
            names.add(child.id)
        elif isinstance(child, ast.Attribute) and child.attr in MARKS:
            names.add(child.attr)
    return names


class Suite:
    def __init__(self, root):
        self.functions = {}
        for path in sorted((pathlib.Path(root) / "tests").glob("*.py")):
            tree = ast.parse(path.read_text())
            self.functions[path.stem] = {
                node.name: node
                for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
        self.shared = {}
        for module in SHARED:
            self.shared.update(
                {name: (module, node) for name, node in self.functions.get(module, {}).items()}
            )
        self._memo = {}

    def find(self, module, name):
        if name in self.functions.get(module, {}):
            return module, self.functions[module][name]
        return self.shared.get(name, (None, None))

    def builds(self, module, name, seen=frozenset()):
        key = (module, name)
        if key in self._memo:
            return self._memo[key]
        found_in, node = self.find(module, name)
        if node is None or key in seen:
            return False
        names = called(node) | {argument.arg for argument in node.args.args}
        result = bool(names & MARKS) or any(
            self.builds(found_in, other, seen | {key})
            for other in names
            if other != name and self.find(found_in, other)[1] is not None
        )
        self._memo[key] = result
        return result

    def tests(self):
        for module, functions in self.functions.items():
            if module.startswith("test_"):
                for name, node in functions.items():
                    if name.startswith("test_") and node.col_offset == 0:
                        yield module, name


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=".")
    parser.add_argument("--by-module", action="store_true")
    args = parser.parse_args()
    suite = Suite(args.root)
    by_module = {}
    for module, name in suite.tests():
        whole, total = by_module.get(module, (0, 0))
        by_module[module] = (whole + suite.builds(module, name), total + 1)
    whole = sum(count for count, _ in by_module.values())
    total = sum(count for _, count in by_module.values())
    print(
        f"test functions that build a whole loop or start a process: {whole} of {total} "
        f"({whole / total:.0%})"
    )
    if args.by_module:
        for module, (count, of) in sorted(by_module.items()):
            print(f"  {module:28s} {count:3d} of {of:3d}")


if __name__ == "__main__":
    main()
