r"""Names a package imports when they are first used (PEP 562).

`flax_loop` and `flax_loop.checkpoint` map each public name to the module
that defines it, so that `import flax_loop` loads nothing heavy and a
program using part of the package (the command line listing files) never
loads JAX:

>>> import types
>>> package = types.ModuleType("package")
>>> package.__getattr__, package.__dir__ = lazy("package", vars(package), {"sqrt": "math"})
>>> package.sqrt(4.0), "sqrt" in vars(package)   # imported, then kept
(2.0, True)
"""

import importlib
from collections.abc import Callable, Mapping
from typing import Any

_OFFERED: dict[str, dict[str, str]] = {}


def offer(package: str, homes: Mapping[str, str]) -> None:
    r"""Makes `homes`' names reachable from `package` too, as its own are.

    A package above `package` in the layers offers its names there (the
    output writers in `flax_loop.checkpoint`, where flax-extra programs
    import them from) without `package` naming anything above it.
    """
    _OFFERED.setdefault(package, {}).update(homes)


def lazy(
    package: str, namespace: dict[str, Any], homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    r"""A package's `__getattr__` and `__dir__` over `homes` (`{name:
    module}`; a name whose module is `package.name` is that submodule) and
    the names offered to it (`offer`)."""
    offered = _OFFERED.setdefault(package, {})

    def __getattr__(name: str) -> Any:
        home = homes.get(name) or offered.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(home)
        value = module if home == f"{package}.{name}" else getattr(module, name)
        namespace[name] = value  # looked up once
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes) | set(offered))

    return __getattr__, __dir__
