"""The import rules of docs/architecture.md, read from the source (an AST walk, no imports run):

- the stream package (packages/streaming) imports nothing of the project's and nothing of Django
  or Channels, and no word of the app's is in its code;
- a backend knows no Django models, no HTTP requests or responses, no generation or row;
- below the transports (views, consumers, encoders, admin), nothing imports them;
- nothing imports a private (underscore) name from another module, nor uses a dependency's;
- no import cycle, deferred imports included.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
#: Each package's folder: its modules are named from the folder's parent.
PACKAGES = {
    "streaming": ROOT / "packages/streaming/src/streaming",
    "quotes": ROOT / "quotes",
    "config": ROOT / "config",
}
STREAMING = "packages/streaming/src/streaming"
TRANSPORTS = (
    "quotes.views",
    "quotes.chat_api",
    "quotes.consumers",
    "quotes.encoders",
    "quotes.admin",
    "django.http",
    "channels",
)

# What each layer (a folder, or a module) may not import (a module, or any module inside it).
FORBIDDEN = {
    STREAMING: ("quotes", "config", "django", "channels"),
    "quotes/backends": (
        *TRANSPORTS,
        *("quotes.models", "quotes.streams", "quotes.rows", "quotes.admission", "quotes.rate_limits"),
        *("quotes.cache", "quotes.state", "django.db", "django.shortcuts", "django.template"),
    ),
    **{
        f"quotes/{name}.py": TRANSPORTS
        for name in (
            *("streams", "rows", "admission", "rate_limits", "spend", "sockets", "state", "registry"),
            *("cache", "personas", "services", "models", "errors", "clients"),
        )
    },
    "quotes/consumers.py": ("quotes.views", "quotes.chat_api", "quotes.admin"),
    "quotes/views.py": ("quotes.chat_api",),
    "quotes/ops": ("quotes.views", "quotes.consumers", "quotes.admin"),
}

# Known breaches, each with the reason it stays: none today. A new breach fails the test.
PRIVATE_IMPORT_EXCEPTIONS: set[tuple[str, str, str | None]] = set()


def modules() -> Iterator[tuple[Path, str]]:
    for folder in PACKAGES.values():
        for path in sorted(folder.rglob("*.py")):
            if "migrations" in path.parts:
                continue
            parts = list(path.relative_to(folder.parent).with_suffix("").parts)
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
            if not (rel == layer or rel.startswith(layer + "/")):
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


def test_the_stream_package_speaks_no_word_of_the_app() -> None:
    """Its code (not its docs) names no model service, no page library, nothing of quotes."""
    words = ("cloudflare", "workers ai", "cf-aig", "htmx", "quote", "persona", "django")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted(PACKAGES["streaming"].rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(word in line.lower() for word in words)
    ]
    assert found == []


def test_the_rules_see_a_breach() -> None:
    """The walk itself works: it finds a relative import of a private name and resolves it."""
    path = ROOT / "quotes" / "backends" / "local.py"
    tree = ast.parse("from ..views import _x\nfrom . import base\n")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.append((resolve("quotes.backends.local", path, node), node.names[0].name))
    assert found == [("quotes.views", "_x"), ("quotes.backends", "base")]


#: Private attributes a dependency documents: Django's Model._state and Model._meta.
DOCUMENTED_PRIVATE = {"_state", "_meta"}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def foreign_private_attributes(trees: dict[str, ast.AST]) -> list[str]:
    """Private attributes used in `trees` (file -> AST) that the project neither defines (a def,
    a class, a variable, a keyword) nor both sets and reads (its own mark on a request): a dependency's.
    getattr/setattr/hasattr with a literal name count. (An undocumented public name, or an
    overridden method, is beyond a name rule.)"""
    defined: set[str] = set()
    written: set[str] = set()
    read: set[str] = set()
    uses = []
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.keyword) and node.arg:  # annotate(_name=...)
                defined.add(node.arg)
            elif isinstance(node, ast.Attribute):
                uses.append((rel, node.lineno, node.attr))
                (written if isinstance(node.ctx, ast.Store) else read).add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                uses.append((rel, node.lineno, node.args[1].value))
                (written if node.func.id == "setattr" else read).add(node.args[1].value)
    own = defined | (written & read) | DOCUMENTED_PRIVATE
    return [f"{rel}:{line} uses {name}" for rel, line, name in uses if private(name) and name not in own]


def test_no_private_attribute_of_a_dependency() -> None:
    trees = {path.relative_to(ROOT).as_posix(): ast.parse(path.read_text()) for path, _ in modules()}
    assert foreign_private_attributes(trees) == []


def test_the_private_attribute_rule_sees_a_breach() -> None:
    code = (
        "pool._shutdown\nresponse._csp_exempt = True\n"
        "request._mine = 1\ngetattr(request, '_mine')\nclass A:\n    def _own(self): self._own()\n"
    )
    assert foreign_private_attributes({"m.py": ast.parse(code)}) == [
        "m.py:1 uses _shutdown",
        "m.py:2 uses _csp_exempt",
    ]


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
            edges.update(packages_run(module, target, known))
    return graph


def packages_run(module: str, target: str, known: set[str]) -> set[str]:
    """The packages whose `__init__` Python runs when `module` imports `target`: each package
    above `target`, but for those above `module` itself (already imported, or importing)."""
    parts = target.split(".")
    above = {".".join(parts[:n]) for n in range(1, len(parts))}
    mine = {".".join(module.split(".")[:n]) for n in range(1, len(module.split(".")) + 1)}
    return {package for package in above - mine if package in known}


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


def test_the_cycle_check_counts_a_package_init() -> None:
    """Importing `quotes.admin.analytics` runs `quotes/admin/__init__.py` first: the graph has
    that edge; a module's own packages are not counted (they are being imported already)."""
    known = {"quotes", "quotes.admin", "quotes.admin.analytics", "quotes.services"}
    assert packages_run("quotes.services", "quotes.admin.analytics", known) == {"quotes.admin"}
    assert packages_run("quotes.admin.analytics", "quotes.admin.charts", known) == set()
