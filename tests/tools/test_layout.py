"""The tools' shape: the simulator never imports the gateway, and no module imports in a cycle.

The simulator is the gateway's independent witness: if it borrowed the gateway's
token counter or error shapes, a bug there would agree with itself in every
test. Import cycles are how that kind of coupling creeps back in (an API module
reaching back into the module that wires it), so both are checked on the source.
"""

from __future__ import annotations

import ast
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "gateway" / "tools"


def _module_name(path: Path) -> str:
    parts = path.relative_to(TOOLS.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The `gateway...` modules the file imports, at any depth (lazy imports count too).

    `from package import module` imports that module, not names of the package's
    `__init__`; `from package import name` does import the `__init__`.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return {name for name in found if name == "gateway" or name.startswith("gateway.")}


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in TOOLS.rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {target for target in _imports(path, set(modules)) if target in modules} - {name}
        for name, path in modules.items()
    }


def test_the_simulator_imports_nothing_of_the_gateway() -> None:
    modules = _modules()
    offenders = {
        _module_name(path): sorted(
            name
            for name in _imports(path, set(modules))
            if not name.startswith("gateway.tools.simulator")
        )
        for path in (TOOLS / "simulator").rglob("*.py")
    }
    assert {module: names for module, names in offenders.items() if names} == {}


def test_no_import_cycles_in_tools() -> None:
    graph = _graph()
    # A package's __init__ imports its modules, so a module that imports names from its own
    # package's __init__ closes a cycle: those edges are kept.
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []
