"""The source tree's shape (issue 29): every module small enough to read in one sitting,
no submodule importing its own package's ``__init__`` (an upward import, held together
by import order), no circle among the imports a module runs when it is imported, and no
two modules importing each other even from inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import steadfast

SRC = Path(steadfast.__file__).parent
#: The most lines a module may have (the issue's bound).
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _source(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a ``from X import ...`` in ``package`` reads."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return base


def _top_level_imports(name: str, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """``(module imported, names taken from it)`` for each import that runs when ``name``
    is imported (not those inside functions, nor under ``TYPE_CHECKING``)."""
    tree = ast.parse(modules[name].read_text())
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                found.extend((a.name, []) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.append((_source(node, package), [a.name for a in node.names]))

    visit(tree.body)
    return found


def _all_imports(name: str, modules: dict[str, Path]) -> set[str]:
    """The modules of steadfast ``name`` imports anywhere, inside functions too (not under
    ``TYPE_CHECKING``)."""
    tree = ast.parse(modules[name].read_text())
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
        for sub in ast.walk(node)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = _source(node, package)
            subs = {f"{base}.{a.name}" for a in node.names} & modules.keys()
            found |= subs or ({base} & modules.keys())
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & modules.keys()
    return found - {name}


def test_no_two_modules_import_each_other() -> None:
    """A lazy import inside a function hides a circle from the import-time check below
    (checkpoint/proof.py and rerun/machine.py did so): no two modules may import each
    other at all. A package and its own submodules are left out (its ``__init__``
    re-exports them)."""
    modules = _modules()
    plain = [n for n in modules if not _is_package(n, modules)]
    imports = {n: _all_imports(n, modules) for n in plain}
    mutual = sorted(
        (a, b) for a in plain for b in imports[a] if b in imports and a in imports[b] and a < b
    )
    assert mutual == [], mutual


def test_no_module_is_over_600_lines() -> None:
    big = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert big == {}, big


def test_no_submodule_imports_its_own_package_init() -> None:
    """``from . import X`` is fine when X is a sibling module; taking a name that the
    package's ``__init__`` defines (or re-exports) from inside the package is not."""
    modules = _modules()
    upward = []
    for name in modules:
        if _is_package(name, modules):
            continue
        for target, names in _top_level_imports(name, modules):
            if target in modules and _is_package(target, modules) and name.startswith(target):
                taken = [n for n in names if f"{target}.{n}" not in modules]
                if taken or not names:
                    upward.append(f"{name} <- {target}: {taken}")
    assert upward == [], upward


def test_no_import_circle() -> None:
    """The graph of module-level imports between steadfast's own modules has no cycle
    (a package's ``__init__`` importing its submodules is an edge like any other)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name in modules:
        for target, names in _top_level_imports(name, modules):
            subs = {f"{target}.{n}" for n in names} & modules.keys()
            graph[name] |= (subs or ({target} & modules.keys())) - {name}
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert circles == [], circles
