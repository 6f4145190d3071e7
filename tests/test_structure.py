"""The package's shape: no import cycles (counting imports inside functions too), and no file too long to read."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "llmkit"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The llmkit modules `name` imports, at any depth of its code: `import a.b` and `from a.b import c` give a.b,
    or a.b.c when c is itself a module."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


FUNCTION_LINES = 80  # a function that needs more is doing two things: split it where the concepts part


def test_no_function_is_too_long_to_read():
    """The size budget is per function, not per file: a module holds one concept whatever its length, and each of
    its functions reads on one screen (docstring included)."""
    long = {}
    for p in (SRC / PACKAGE).rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > FUNCTION_LINES:
                    long[f"{p.relative_to(SRC)}:{node.lineno} {node.name}"] = n
    assert long == {}


def test_no_import_cycles_between_subpackages():
    """Collapsed to llmkit's subpackages and top-level modules (llmkit.train, llmkit.config, ...), the imports still
    form no cycle: each layer of the package builds only on the ones below it."""
    modules = _modules()
    top = {m: ".".join(m.split(".")[:2]) for m in modules}
    graph: dict[str, set[str]] = {t: set() for t in top.values() if t != PACKAGE}
    for name, path in modules.items():
        if top[name] == PACKAGE:  # the package's own __init__ re-exports from everywhere
            continue
        graph[top[name]] |= {top[m] for m in _imports(name, path, modules) if top[m] not in (top[name], PACKAGE)}
    assert _cycles(graph) == []
