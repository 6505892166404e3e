"""The import graph of a package, read from its sources: every `import` and `from ... import`, at
module level and inside functions and classes alike (imports under `if TYPE_CHECKING:` are left
out: they never run). An edge A -> B says module A imports module B; importing a name from a
package that is not one of its submodules is an edge to the package's __init__. The implicit
import of a module's parent packages is not an edge (every submodule would close a circle)."""

from __future__ import annotations

import ast
import pathlib


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    """The dotted module name of `path` under the directory `root` that holds the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_sources(root: pathlib.Path, package: str) -> tuple[dict[str, str], set[str]]:
    """({module name: source} of every module of `package`, a directory under `root`; the names
    among them that are packages)."""
    paths = sorted((root / package).rglob("*.py"))
    return ({module_name(root, path): path.read_text() for path in paths},
            {module_name(root, path) for path in paths if path.name == "__init__.py"})


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _known(name: str, modules: set[str]) -> str | None:
    """`name` or the nearest package above it that is one of `modules`."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(me: str, is_package: bool, tree: ast.AST, modules: set[str]) -> set[str]:
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                out.update(filter(None, (_known(alias.name, modules) for alias in child.names)))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package holding this module
                    package = me if is_package else me.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    out.add(full if full in modules else _known(base, modules))
            else:
                visit(child)

    visit(tree)
    out.discard(None)
    out.discard(me)
    return out


def import_graph(sources: dict[str, str], packages: set[str] = frozenset()) -> dict[str, set[str]]:
    """{module: the modules of `sources` it imports}; `packages`: the names in `sources` that are
    packages (their __init__), for relative imports."""
    modules = set(sources)
    return {name: _imports(name, name in packages, ast.parse(text), modules) for name, text in sources.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each strongly connected set of two or more modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)
