"""The import rules of docs/architecture.md, read from the source (an AST walk, no imports run):

- a backend (quotes/ai/backends) knows no Django models, no HTTP requests or responses;
- the gateway (quotes/ai/gateway) knows no transport: no views, consumers, encoders, SSE bytes,
  Django HTTP or Channels;
- nothing imports a private (underscore) name from another module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("quotes", "config")

# What each layer may not import (a module, or any module inside it).
FORBIDDEN = {
    "quotes/ai/backends": (
        "quotes.models",
        "quotes.views",
        "quotes.admin",
        "quotes.admin_views",
        "quotes.consumers",
        "quotes.transports",
        "quotes.ai.gateway",
        "django.db",
        "django.http",
        "django.shortcuts",
        "django.template",
        "channels",
    ),
    "quotes/ai/gateway": (
        "quotes.views",
        "quotes.admin",
        "quotes.admin_views",
        "quotes.consumers",
        "quotes.transports",
        "quotes.ai.sse",
        "django.http",
        "django.shortcuts",
        "django.template",
        "channels",
    ),
}

# Known breaches, each with the reason it stays: none today. A new breach fails the test.
PRIVATE_IMPORT_EXCEPTIONS: set[tuple[str, str, str | None]] = set()


def modules() -> Iterator[tuple[Path, str]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield path, ".".join(parts)


def resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path, module: str) -> Iterator[tuple[str, str | None, int]]:
    """(module, name or None, line) for every import in the file, wherever it is (a function's
    deferred import counts too)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, path, node)
            for alias in node.names:
                yield source, alias.name, node.lineno


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_layers_import_only_what_they_may() -> None:
    breaches = []
    for path, module in modules():
        rel = path.relative_to(ROOT).as_posix()
        for layer, forbidden in FORBIDDEN.items():
            if not rel.startswith(layer + "/"):
                continue
            for source, name, line in imports(path, module):
                # `from quotes import models` names the module quotes.models
                targets = [source] + ([f"{source}.{name}"] if name else [])
                if any(within(target, bad) for target in targets for bad in forbidden):
                    breaches.append(f"{rel}:{line} imports {targets[-1]}")
    assert breaches == []


def test_nothing_imports_a_private_name_across_modules() -> None:
    breaches = []
    for path, module in modules():
        rel = path.relative_to(ROOT).as_posix()
        for source, name, line in imports(path, module):
            private_module = any(
                part.startswith("_") and not part.startswith("__") for part in source.split(".")
            )
            private_name = name is not None and name.startswith("_") and not name.startswith("__")
            if not (private_module or private_name) or source == module:
                continue
            if (rel, source, name) in PRIVATE_IMPORT_EXCEPTIONS:
                continue
            breaches.append(f"{rel}:{line} imports {name or ''} from {source}")
    assert breaches == []


def test_the_rules_see_a_breach() -> None:
    """The walk itself works: it finds a relative import of a private name and resolves it."""
    path = ROOT / "quotes" / "ai" / "gateway" / "policy.py"
    tree = ast.parse("from ...views import _x\nfrom .. import sse\n")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.append((resolve("quotes.ai.gateway.policy", path, node), node.names[0].name))
    assert found == [("quotes.views", "_x"), ("quotes.ai", "sse")]


def module_graph() -> dict[str, set[str]]:
    """Which of the project's modules each imports, deferred and TYPE_CHECKING imports included.
    `from package import name` names the submodule when `name` is one, else the package."""
    known = {module for _, module in modules()}
    graph: dict[str, set[str]] = {}
    for path, module in modules():
        edges = graph.setdefault(module, set())
        for source, name, _ in imports(path, module):
            target = f"{source}.{name}" if name and f"{source}.{name}" in known else source
            if target in known and target != module:
                edges.add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    """Calls go down: no import cycle among the project's modules, deferred imports included
    (a deferred import hides a cycle from Python, not from a reader)."""
    assert cycles(module_graph()) == []


def test_the_cycle_check_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
