"""The packages of superneurons form a stack: every import, function-local ones included, goes down it.

From the top: the entry points (`__main__.py`, then `cli.py`, then `superneurons/__init__.py`, pycaffe's
`import superneurons as caffe`), then `commands` and `pycaffe` (side by side: neither imports the other),
`parallel`, `solver`, `runtime`, `memory`, `graph`, `layers`, `data`, `backend`, `io`, `settings`, and at
the bottom `errors`, `dtypes` and the generated `proto` modules. An import of a package at the same or a higher level
fails, and so does a cycle between modules (within a package too), each named with the imports that make it.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "superneurons"

# Highest first; one entry per level, several packages on one level may not import each other.
STACK: list[tuple[str, ...]] = [
    ("__main__",),
    ("cli",),
    ("__init__",),
    ("commands", "pycaffe"),
    ("parallel",),
    ("solver",),
    ("runtime",),
    ("memory",),
    ("graph",),
    ("layers",),
    ("data",),
    ("backend",),
    ("io",),
    ("settings",),
    ("errors", "proto", "dtypes"),
]
LEVEL = {unit: len(STACK) - i for i, units in enumerate(STACK) for unit in units}


def unit_of(module: str) -> str | None:
    """The stack unit of a dotted module name of this package (None for other packages)."""
    parts = module.split(".")
    if parts[0] != "superneurons":
        return None
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=None)
def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file at `path` (see `imports_in`)."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_in(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in `source` (module `module`), at any depth, and
    every `importlib.import_module("...")` with a literal name. `from x import y` counts as x.y when y is a
    module of this package, else as x."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub) else base))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def _is_module(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != "superneurons":
        return False
    base = PACKAGE.parent.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the imports that make the edge, as 'file:line: module'."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = unit_of(module_name(path))
        for line, target in imports_of(path):
            dst = unit_of(target)
            if dst is None or dst == src or src is None:
                continue
            rel = path.relative_to(PACKAGE.parent).as_posix()
            edges.setdefault((src, dst), []).append(f"{rel}:{line}: {target}")
    return edges


def test_the_stack_names_every_package_and_top_level_module():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py") or (p / "__init__.py").is_file()}
    assert sorted(units - set(LEVEL)) == []


def test_no_import_goes_up_the_stack():
    upward = [f"{src} -> {dst} ({where[0]}{' and %d more' % (len(where) - 1) if len(where) > 1 else ''})"
              for (src, dst), where in sorted(package_edges().items()) if LEVEL[dst] >= LEVEL[src]]
    assert upward == []


def module_edges() -> dict[str, dict[str, str]]:
    """module -> {imported module of this package: 'file:line'} (a name imported from a package counts as
    an import of the package's __init__)."""
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for line, target in imports_of(path):
            if unit_of(target) is None:
                continue
            while not _is_module(target):
                target = target.rpartition(".")[0]
            if target != me:
                edges.setdefault(me, {}).setdefault(target, f"{rel}:{line}")
    return edges


def shortest_cycle(edges: dict[str, dict[str, str]], start: str) -> list[str] | None:
    """The shortest chain of imports from `start` back to `start`, breadth first; None when there is none."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for u in frontier:
            for v in sorted(edges.get(u, ())):
                if v == start:
                    return paths[u] + [v]
                if v not in paths:
                    paths[v] = paths[u] + [v]
                    nxt.append(v)
        frontier = nxt
    return None


def describe(edges: dict[str, dict[str, str]], chain: list[str]) -> str:
    return " -> ".join(chain) + " (" + "; ".join(edges[a][b] for a, b in zip(chain, chain[1:])) + ")"


def test_no_cycle_between_packages():
    units: dict[str, dict[str, str]] = {}
    for (src, dst), where in package_edges().items():
        units.setdefault(src, {})[dst] = where[0]
    cycles = {tuple(c) for c in (shortest_cycle(units, u) for u in sorted(units)) if c}
    assert sorted(describe(units, list(c)) for c in cycles) == []


def test_no_cycle_between_modules():
    edges = module_edges()
    seen: set[frozenset[str]] = set()
    cycles = []
    for module in sorted(edges):
        chain = shortest_cycle(edges, module)
        if chain and frozenset(chain) not in seen:
            seen.add(frozenset(chain))
            cycles.append(describe(edges, chain))
    assert cycles == []


def test_the_checker_sees_every_kind_of_import():
    # The rules above are only as good as imports_in: an import inside a function or under TYPE_CHECKING,
    # a relative import and importlib.import_module must all count, or an upward import could hide there.
    source = """
from typing import TYPE_CHECKING
from . import plan
from ..graph import node
if TYPE_CHECKING:
    from superneurons.runtime.net import Net
def f():
    import superneurons.solver.solver
    importlib.import_module("superneurons.commands.train")
"""
    found = [m for _, m in imports_in(source, "superneurons.memory.cost", is_package=False)]
    assert found[1:] == ["superneurons.memory.plan", "superneurons.graph.node", "superneurons.runtime.net",
                         "superneurons.solver.solver", "superneurons.commands.train"], found
    assert [m for _, m in imports_in("from . import pool", "superneurons.memory", is_package=True)] == [
        "superneurons.memory.pool"]
    assert unit_of("superneurons.runtime.net") == "runtime" and unit_of("numpy") is None
    chain = shortest_cycle({"a": {"b": "a.py:1"}, "b": {"c": "b.py:2"}, "c": {"a": "c.py:3"}}, "a")
    assert chain == ["a", "b", "c", "a"]
