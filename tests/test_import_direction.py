"""The floor plan holds: rooms import only from rooms before them in the loop, and nothing imports in a circle.

Every ``import`` in ``src/sdcscope`` counts, function-level (lazy) ones too. ``docs/architecture.md``
explains the order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "sdcscope"
ROOMS = (
    "common", "faults", "inject", "workloads", "engine", "observe", "detect", "invariants", "localize",
    "mitigate", "guard", "integrations", "jobs", "study", "cli",
)  # fmt: skip
"""The rooms in loop order: each may import only from itself and the rooms before it."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)`` for every sdcscope import in ``path``."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    return imports_in(path.read_text(), package)


def imports_in(source: str, package: str) -> list[tuple[str, int, bool]]:
    tree = ast.parse(source)
    top = {id(node) for node in tree.body} | {
        id(n)
        for node in tree.body
        if isinstance(node, (ast.If, ast.Try)) and not type_checking(node)
        for n in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names]  # a module or a name in one: resolved by the caller
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(n, node.lineno, id(node) in top) for n in names if n.split(".")[0] == "sdcscope"]
    return found


def type_checking(node: ast.stmt) -> bool:
    """``if TYPE_CHECKING:``: imports for annotations only, never run."""
    test = getattr(node, "test", None)
    return isinstance(test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(test)


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (SRC / parts[1]).is_dir() else None


MODULES = sorted(SRC.rglob("*.py"))


def test_every_package_is_a_room_in_the_loop_order():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(ROOMS)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_a_room_imports_only_from_rooms_before_it(path):
    mine = room(module_name(path))
    upward = []
    for target, line, _ in imports(path):
        theirs = room(target)
        if mine is None or theirs is None:  # the top-level package: its version only; __main__ runs the CLI
            entry = module_name(path) == "sdcscope.__main__" and theirs == "cli"
            assert theirs is None or mine is not None or entry, f"{path}:{line} sdcscope/__init__ imports {target}"
            continue
        if ROOMS.index(theirs) > ROOMS.index(mine):
            upward.append(f"{path.relative_to(SRC)}:{line} imports {target} ({mine} -> {theirs})")
    assert not upward, "imports against the loop order:\n" + "\n".join(upward)


def registers(module: str, target: str) -> bool:
    """The CLI's local pattern: ``cli/app.py`` imports the command modules that register on its app."""
    return module == "sdcscope.cli.app" and target.startswith("sdcscope.cli.") and target.endswith("_cmd")


def test_no_module_imports_itself_in_a_circle():
    """Among module-level imports (those that run on import), no cycle of modules."""
    names = {module_name(p): p for p in MODULES}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        deps = set()
        for target, _, at_top in imports(path):
            if not at_top:
                continue
            while target not in names and "." in target:  # `from pkg.mod import name`
                target = target.rpartition(".")[0]
            if target in names and target != name and not registers(name, target):
                deps.add(target)
        graph[name] = deps
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_scan_sees_lazy_and_relative_imports():
    """The scan itself: a function-level import and a relative import are both found."""
    source = "def f():\n    from sdcscope.study import x\nfrom . import session\nfrom .actions import Loop\n"
    found = [(t, top) for t, _, top in imports_in(source, "sdcscope.guard")]
    assert ("sdcscope.study.x", False) in found
    assert ("sdcscope.guard.session", True) in found and ("sdcscope.guard.actions.Loop", True) in found
