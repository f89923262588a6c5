"""No import cycles among tinyserve's modules, type-only ones included (STYLE.md: a cycle says two modules
are one concern or a contract is missing). The graph is read from the source with `ast`, not from what
Python happens to import: every import statement counts wherever it stands (module level, inside a
function, under `if TYPE_CHECKING:`), so a lazy import cannot hide a cycle."""

import ast
import textwrap
from pathlib import Path

import tinyserve

PACKAGE_DIR = Path(tinyserve.__file__).parent


def module_paths(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> its file, for every .py under package_dir (a package is its __init__)."""
    paths = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        paths[".".join(parts)] = path
    return paths


def _nearest_module(name: str, modules: set[str]) -> str | None:
    """The module that `import name` runs last: name itself, or the package above a non-module name."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _from_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name `from <...> import` reads from, relative levels resolved against module."""
    if node.level == 0:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imported_modules(module: str, path: Path, modules: set[str]) -> set[str]:
    """Our modules that module imports anywhere in its file. `from pkg import name` is an edge to the
    submodule pkg.name when there is one, otherwise to pkg itself."""
    is_package = path.name == "__init__.py"
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, is_package, node)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        targets.update(_nearest_module(name, modules) for name in names)
    targets.discard(None)
    targets.discard(module)
    return targets


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    paths = module_paths(package_dir)
    return {module: imported_modules(module, path, set(paths)) for module, path in paths.items()}


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; each component sorted, components in the order they close."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per component of more than one module: its modules, then the imports inside it."""
    lines = []
    for component in strongly_connected_components(graph):
        if len(component) > 1:
            members = set(component)
            edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
            lines.append(f"{{{', '.join(component)}}}: {'; '.join(edges)}")
    return lines


def test_tinyserve_has_no_import_cycles():
    found = cycles(import_graph(PACKAGE_DIR))
    assert not found, "import cycles:\n" + "\n".join(found)


def test_graph_covers_the_whole_package():
    graph = import_graph(PACKAGE_DIR)
    assert "tinyserve.engine.loop.llm_engine" in graph
    assert "tinyserve.server.app" in graph
    assert "tinyserve.types" in graph["tinyserve.engine.loop.request"]


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root / "pkg"


def test_type_only_and_function_level_imports_close_cycles(tmp_path):
    package_dir = _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.b import B
        """,
        "pkg/b.py": """
            def make():
                from . import c
        """,
        "pkg/c.py": "import pkg.a\n",
        "pkg/d.py": "from pkg.a import *\n",
    })
    assert cycles(import_graph(package_dir)) == [
        "{pkg.a, pkg.b, pkg.c}: pkg.a -> pkg.b; pkg.b -> pkg.c; pkg.c -> pkg.a"
    ]


def test_relative_imports_resolve_and_package_edges_are_real(tmp_path):
    package_dir = _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from .x import X\n",
        "pkg/sub/x.py": "from ..y import helper\nX = 1\n",
        "pkg/y.py": "from pkg.sub import x\nfrom pkg import sub\n",
    })
    graph = import_graph(package_dir)
    assert graph["pkg.sub"] == {"pkg.sub.x"}
    assert graph["pkg.sub.x"] == {"pkg.y"}
    assert graph["pkg.y"] == {"pkg.sub.x", "pkg.sub"}
    assert graph["pkg"] == set()
    assert cycles(graph) == [
        "{pkg.sub, pkg.sub.x, pkg.y}: pkg.sub -> pkg.sub.x; pkg.sub.x -> pkg.y; pkg.y -> pkg.sub; pkg.y -> pkg.sub.x"
    ]
