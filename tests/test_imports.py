"""The graph of project-module imports across the tree: no circle between any two modules, none importing many.

The counting rule. Every `.py` file of a project package is a module; a package's `__init__.py` (its front door)
is the module named for the package. Every import in a file counts, at module level or inside a function or an
`if TYPE_CHECKING:` block, since each is a dependency a reader must follow. An import names the deepest module it
reaches: `import a.b.c` and `from a.b import c` (when `c` is a module) count `a.b.c`; `from a.b import name` (a
name, not a module) counts `a.b`, the front door that lends it; a relative import is resolved first. The parent
packages that Python runs on the way to a module are not counted (else every module would depend on its own front
door), and neither are names a front door lends lazily by string (`dpo_data.__init__`'s table). A module importing
itself is no edge."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dpo_data", "dpo_state", "dpo_report", "dpo_train", "cli", "dpo_cli")

FAN_OUT = 15
"""At most this many project modules imported by one module (issue 58, item 6): 19 before the fourth pass
(dpo_train.run.setup and dpo_data.prepare.build)."""


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """dotted name -> file, for every module of the project packages under `root`."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _deepest(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest project module that `name` (a dotted module or module.attribute path) reaches."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.Import | ast.ImportFrom, module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {_deepest(alias.name, modules) for alias in node.names} - {None}
    base = node.module or ""
    if node.level:  # relative: a package's own name for its __init__, the containing package for a module
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    return {_deepest(f"{base}.{alias.name}", modules) for alias in node.names} - {None}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports, by the counting rule of this file's docstring."""
    modules = project_modules(root)
    graph = {}
    for module, path in modules.items():
        nodes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
        graph[module] = set().union(*(_imported(n, module, path, modules) for n in nodes)) - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = stack[stack.index(node) :]
                del stack[stack.index(node) :]
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def too_wide(graph: dict[str, set[str]], limit: int = FAN_OUT) -> dict[str, int]:
    """module -> how many project modules it imports, for those importing more than `limit`."""
    return {module: len(used) for module, used in sorted(graph.items()) if len(used) > limit}


def test_no_circle_between_any_two_modules():
    """A circle hidden by an import inside a function still ties its modules together: neither can be read,
    tested or moved without the other."""
    assert circles(import_graph()) == []


def test_no_module_imports_more_than_fifteen_project_modules():
    assert too_wide(import_graph()) == {}


def test_the_graph_resolves_each_form_of_import(tmp_path):
    """The walk sees what the rule says: a submodule named by `from`, a name lent by a front door, a relative
    import, an import inside a function; and finds a circle and a wide module when they are there."""
    package = tmp_path / "dpo_data"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from dpo_data.sub import leaf\n")
    (package / "sub" / "__init__.py").write_text("from .leaf import NAME\n")
    (package / "sub" / "leaf.py").write_text("def f():\n    from dpo_data import other\n")
    (package / "other.py").write_text("from dpo_data.sub import NAME\nimport dpo_data.sub.leaf.thing\n")
    graph = import_graph(tmp_path)
    assert graph == {
        "dpo_data": {"dpo_data.sub.leaf"},
        "dpo_data.sub": {"dpo_data.sub.leaf"},
        "dpo_data.sub.leaf": {"dpo_data.other"},
        "dpo_data.other": {"dpo_data.sub", "dpo_data.sub.leaf"},
    }
    assert circles(graph) == [["dpo_data.other", "dpo_data.sub", "dpo_data.sub.leaf"]]
    assert too_wide(graph, limit=1) == {"dpo_data.other": 2}
