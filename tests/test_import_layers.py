"""nixlkv's packages import downward only: production code never reaches into the test kit.

The rooms, lowest first: ``core`` (numpy and pluggy only, :mod:`tests.test_core_isolation`);
``scenario_kinds`` (the neutral description of a plugin's layer kind); ``strategies`` and
``transport`` (each just above core); ``vllm`` (the connector's parts); ``connector`` (the facade
vLLM loads); then the tooling that proves and measures them: ``testing``, ``bench``, ``serving``,
``cli``. Every import, lazy ones inside functions included, is read from the source.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import nixlkv

PACKAGE_DIR = Path(nixlkv.__file__).resolve().parent

# room -> the rooms it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "scenario_kinds": {"core"},
    "strategies": {"core", "scenario_kinds"},
    "transport": {"core"},
    "vllm": {"core", "transport"},
    "connector": {"core", "vllm"},
    "testing": {"core", "scenario_kinds", "transport", "vllm"},
    "bench": {"core", "transport", "vllm", "testing"},
    "serving": {"core", "transport", "vllm", "testing"},
    "cli": {"core", "testing", "bench", "serving"},
    "nixlkv": set(),  # the package's own __init__
}
PRODUCTION = ("core", "scenario_kinds", "strategies", "transport", "vllm", "connector")
TOOLING = ("testing", "bench", "serving", "cli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "nixlkv"


def imports_of(source: str, module: str, is_package: bool) -> Iterator[tuple[str, list[str], int]]:
    """(imported nixlkv module, names taken from it, line) of every import in ``source``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "nixlkv":
                    yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "nixlkv":
                target = node.module
            else:
                continue
            yield target, [a.name for a in node.names], node.lineno


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _edges() -> Iterator[tuple[str, str, list[str], int]]:
    """(importing module, imported module, names taken, line); ``from pkg import module`` names
    the module itself."""
    modules = _modules()
    for module, path in modules.items():
        for target, names, line in imports_of(path.read_text(), module, path.name == "__init__.py"):
            submodules = [n for n in names if f"{target}.{n}" in modules]
            for name in submodules:
                yield module, f"{target}.{name}", [], line
            if not submodules or len(submodules) < len(names):
                yield module, target, [n for n in names if n not in submodules], line


def test_every_room_is_known() -> None:
    rooms = {_room(m) for m in _modules()}
    assert {"core", "strategies", "transport", "vllm", "connector", "testing"} <= rooms  # the real tree
    assert rooms <= set(ALLOWED), f"a new top-level module or package needs its place: {sorted(rooms - set(ALLOWED))}"


def test_production_code_imports_nothing_of_the_test_kit_or_the_tooling() -> None:
    offenders = [
        f"{module}:{line} imports {target}"
        for module, target, _, line in _edges()
        if _room(module) in PRODUCTION and _room(target) in TOOLING
    ]
    assert offenders == []


def test_every_import_points_down() -> None:
    offenders = [
        f"{module}:{line} ({_room(module)}) imports {target} ({_room(target)})"
        for module, target, _, line in _edges()
        if _room(target) != _room(module) and _room(target) not in ALLOWED[_room(module)]
    ]
    assert offenders == []


def test_no_import_cycle_between_modules() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, target, _, _ in _edges():
        if target in modules and target != module:
            graph[module].add(target)
    cycles = _cycles(graph)
    assert cycles == []


def test_no_private_name_is_imported_from_another_module() -> None:
    offenders = [
        f"{module}:{line} takes {name} from {target}"
        for module, target, names, line in _edges()
        for name in names
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert offenders == []


def test_the_scan_would_catch_a_test_kit_import() -> None:
    """Negative control: the scanner sees absolute, relative and lazy imports of the test kit."""
    sample = "from ..testing.kinds import KINDS\ndef f():\n    import nixlkv.testing.oracle\n    from nixlkv.testing import engines\n"
    found = [t for t, _, _ in imports_of(sample, "nixlkv.strategies.mine", is_package=False)]
    assert found == ["nixlkv.testing.kinds", "nixlkv.testing.oracle", "nixlkv.testing"]
    assert all(_room(t) in TOOLING for t in found)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
