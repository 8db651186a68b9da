"""The import layering DESIGN.md asks for, read from the source with `ast` (nothing is imported).

- admission and scheduling are pure policy: no aiohttp, no HTTP handlers, no upstream;
- upstream (pool, relay, retry) knows nothing of the HTTP handlers;
- observability reads a RequestRecord and knows nothing of the HTTP handlers;
- the simulator is an independent witness: it imports nothing of the gateway but itself;
- no modules import each other, directly or round a loop (a package's `__init__` that
  re-exports its modules counts: a module importing names from its own package's
  `__init__` closes a loop).

Every import counts: at module level, inside functions, and under `TYPE_CHECKING` (a
type-only import still ties one room to another).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gateway"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imported(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in `module`, relative imports resolved."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                # `from gateway import http` imports the module gateway.http.
                found.append((node.lineno, submodule if submodule in MODULES else base))
    return found


@dataclass(frozen=True)
class Rule:
    layer: str
    forbidden: tuple[str, ...] = ()
    #: When set, everything of `gateway` outside these is forbidden.
    only_gateway: tuple[str, ...] = ()

    def breaks(self, target: str) -> bool:
        if any(within(target, f) for f in self.forbidden):
            return True
        if self.only_gateway and within(target, "gateway"):
            return not any(within(target, allowed) for allowed in self.only_gateway)
        return False


RULES = [
    Rule("gateway.admission", forbidden=("aiohttp", "gateway.http", "gateway.upstream")),
    Rule("gateway.scheduling", forbidden=("aiohttp", "gateway.http", "gateway.upstream")),
    Rule("gateway.upstream", forbidden=("gateway.http",)),
    Rule("gateway.observability", forbidden=("gateway.http",)),
    Rule("gateway.fleet", forbidden=("gateway.http",)),
    Rule("gateway.tools.simulator", only_gateway=("gateway.tools.simulator",)),
]


def test_every_gateway_module_parses_and_the_layers_exist() -> None:
    assert "gateway.app" in MODULES
    for rule in RULES:
        assert any(within(m, rule.layer) for m in MODULES), f"no module in {rule.layer}"


def test_the_checker_resolves_relative_imports_and_sees_every_import(tmp_path: Path) -> None:
    source = tmp_path / "fake.py"
    source.write_text(
        "from . import scheduler\n"
        "from ..upstream import pool\n"
        "from ..http.errors import error_response\n"
        "import aiohttp.web\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from gateway import http\n"
        "def later():\n"
        "    import gateway.tools.stats\n"
    )
    assert imported("gateway.scheduling.fake", source) == [
        (1, "gateway.scheduling.scheduler"),
        (2, "gateway.upstream.pool"),
        (3, "gateway.http.errors"),
        (4, "aiohttp.web"),
        (5, "typing"),
        (7, "gateway.http"),
        (9, "gateway.tools.stats"),
    ]
    scheduling = RULES[1]
    assert [scheduling.breaks(t) for t in ("aiohttp.web", "gateway.http", "gateway.config")] == [
        True,
        True,
        False,
    ]
    simulator = RULES[-1]
    assert simulator.breaks("gateway.config") and simulator.breaks("gateway")
    assert not simulator.breaks("gateway.tools.simulator.engine")
    assert not simulator.breaks("aiohttp")


@pytest.mark.parametrize("rule", RULES, ids=[rule.layer for rule in RULES])
def test_imports_keep_to_the_layering(rule: Rule) -> None:
    violations = [
        f"{module}:{line} imports {target}"
        for module, path in MODULES.items()
        if within(module, rule.layer)
        for line, target in imported(module, path)
        if rule.breaks(target)
    ]
    assert violations == []


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round a loop (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while (member := stack.pop()) != module:
                group.append(member)
            if group:
                cycles.append(sorted([module, *group]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_the_cycle_finder_finds_a_loop_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_two_modules_import_each_other() -> None:
    """A loop, even through `TYPE_CHECKING` imports, means two rooms are really one."""
    graph = {
        module: {target for _, target in imported(module, path) if target in MODULES} - {module}
        for module, path in MODULES.items()
    }
    assert import_cycles(graph) == []
