"""The layering of the packages, read from the source with ``ast`` (nothing is imported):

* ``policy`` imports nothing of ours outside ``policy``;
* ``browser`` and ``squid_compat`` import only ``policy`` (and themselves);
* nothing imports the command line, ``proxy.cli``: it is the composition root;
* no import cycle among our modules.

Every import counts, also one inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# top-level package -> its directory (squid_compat is mapped in pyproject.toml)
PACKAGES = {"policy": "policy", "proxy": "proxy", "browser": "browser", "squid_compat": "squid-compat/squid_compat",
            "ci": "ci"}
CLI = "proxy.cli"


def module_files(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Module name -> source file, for every .py file under each package directory."""
    modules = {}
    for name, directory in packages.items():
        base = root / directory
        for path in sorted(base.rglob("*.py")):
            parts = [name, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that ``module`` imports: a name is resolved to the longest known module."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    # ``if TYPE_CHECKING:`` imports exist for the type checker only and never run: not edges.
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # "from a import b": b may be a module of its own, or a name defined in a
            names = [f"{origin}.{alias.name}" for alias in node.names] + [origin]
            if any(f"{origin}.{alias.name}" in known for alias in node.names):
                names.remove(origin)
        for name in names:
            target = _longest_known(name, known)
            if target is not None and target != module:
                found.add(target)
    return found


def _longest_known(name: str, known: set[str]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def import_graph(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> dict[str, set[str]]:
    modules = module_files(root, packages)
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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


def top(module: str) -> str:
    return module.split(".", 1)[0]


def in_cli(module: str) -> bool:
    return module == CLI or module.startswith(CLI + ".")


GRAPH = import_graph()


def edges(where) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in GRAPH.items() if where(a) for b in targets)


def test_the_graph_is_read() -> None:
    # the test is about something: the known edges are there
    assert "policy.loader" in GRAPH["proxy.cli.options"]
    assert "proxy.runner" in GRAPH["proxy.cli.embedded"]
    assert "browser.launch" in GRAPH["browser.server"]


def test_policy_imports_nothing_of_ours_outside_policy() -> None:
    assert [e for e in edges(lambda m: top(m) == "policy") if top(e.split(" -> ")[1]) != "policy"] == []


@pytest.mark.parametrize("package", ["browser", "squid_compat"])
def test_browser_and_squid_compat_import_only_policy(package: str) -> None:
    outside = [e for e in edges(lambda m: top(m) == package) if top(e.split(" -> ")[1]) not in (package, "policy")]
    assert outside == []


def test_nothing_imports_the_command_line() -> None:
    assert [e for e in edges(lambda m: not in_cli(m)) if in_cli(e.split(" -> ")[1])] == []


def test_no_import_cycle() -> None:
    assert cycles(GRAPH) == []


# ---- the checker itself can fail -------------------------------------------------------------------

def test_a_planted_cycle_and_a_forbidden_import_are_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from . import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from .c import x\n")  # lazy, still counts
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\nx = 1\n")
    (tmp_path / "pkg" / "d.py").write_text("from pkg.cli import main\n")
    (tmp_path / "pkg" / "cli").mkdir()
    (tmp_path / "pkg" / "cli" / "__init__.py").write_text("from ..a import nothing\nmain = None\n")
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.cli"} and graph["pkg.cli"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
