"""The package's imports form no circle: every import of one linearize module by another, read
statically from the source (module level and inside functions alike, ``if TYPE_CHECKING:`` blocks
aside), gives a graph without cycles."""

import ast
import sys
from pathlib import Path

import linearize

PACKAGE = Path(linearize.__file__).parent

# Cycles that exist and have an owner fixing them; each entry must still be a cycle (delete it when
# it is gone). eval/harness <-> eval/results: the eval package's, removed with its rework (issue 19).
KNOWN_CYCLES: set = set()  # every circle once found is gone; keep it that way


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package's __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imports_of(name: str, path: Path, is_package: bool, known: dict) -> set[str]:
    """The linearize modules ``name`` imports. ``from X import y`` counts as an import of ``X.y`` when
    that is a module, else of ``X`` (its ``__init__``); a parent package's implicit import does not count."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = {id(node) for block in ast.walk(tree)
               if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
               for node in ast.walk(block)}
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "linearize"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "linearize":
                continue
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module, or a module importing itself."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(component)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, is_package, known) & known.keys() for name, (path, is_package) in known.items()}


def test_the_package_imports_no_circle():
    graph = import_graph()
    assert len(graph) > 50 and "linearize.decode.loop" in graph and "linearize.data" in graph
    found = [frozenset(c) for c in cycles(graph)]
    unexpected = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles: {unexpected}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"no longer cycles: {gone}; remove them from KNOWN_CYCLES"


WING = "linearize.convert"  # the conversion wing: convert (its __init__), layers, xatl_transfer
BELOW_WING = ("ops", "mixers", "models", "spec", "kinds", "cache", "errors", "version")
ABOVE_WING = ("decode", "graphed", "data", "distill", "recipes", "eval", "bench", "cli", "demo")


def _in(module: str, parts) -> bool:
    return any(module == f"linearize.{p}" or module.startswith(f"linearize.{p}.") for p in parts)


def wing_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports that point up across the conversion wing: a module below it importing it, or it importing
    a module above it."""
    wing = {m for m in graph if _in(m, [WING.partition(".")[2]])}
    up = [(m, w) for m in graph if _in(m, BELOW_WING) for w in graph[m] & wing]
    up += [(m, t) for m in wing for t in graph[m] if _in(t, ABOVE_WING)]
    return sorted(up)


def test_the_conversion_wing_keeps_its_arrows_down():
    """ops, mixers, models, spec and kinds never import the conversion wing (``linearize.convert``); the
    wing imports no decoder, loss, recipe (LIT is the recipes'), eval, bench or cli module."""
    graph = import_graph()
    assert {WING, f"{WING}.layers", f"{WING}.xatl_transfer", "linearize.recipes.lit"} <= graph.keys()
    assert not wing_arrows(graph), wing_arrows(graph)
    assert wing_arrows({"linearize.mixers.base": {WING}, WING: {"linearize.recipes.lit"},
                        "linearize.recipes.lit": set()}) == [("linearize.convert", "linearize.recipes.lit"),
                                                             ("linearize.mixers.base", "linearize.convert")]


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}, "e": set()}
    assert sorted(sorted(c) for c in cycles(graph)) == [["a", "b", "c"], ["d"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_read_at_every_level(tmp_path):
    """Relative and absolute imports, inside functions too; TYPE_CHECKING imports left out."""
    source = tmp_path / "mod.py"
    source.write_text("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                      "from . import ops\nfrom ..errors import LinearizeError\nimport linearize.cache\n"
                      "if TYPE_CHECKING:\n    from linearize.spec import Spec\n"
                      "def f():\n    from .loop import FastDecoder\n")
    known = {"linearize.ops": None, "linearize.errors": None, "linearize.cache": None, "linearize.spec": None,
             "linearize.decode.loop": None, "linearize.decode": None}
    found = imports_of("linearize.decode.mod", source, False, known)
    assert found == {"linearize.decode", "linearize.errors", "linearize.cache", "linearize.decode.loop"}
