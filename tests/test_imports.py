"""The layers: kernels <- library <- training / inference / benchmarks, without import cycles.

The import graph is read from the source with `ast`, so an import inside a function (a lazy import,
which runs only on some paths) counts as much as one at the top. Importing `a.b.c` from another
package also runs `a/__init__.py` and `a/b/__init__.py`: those edges count too. Then every kernel
module and every package is imported in a fresh interpreter, where a cycle that the graph misses
(or an import that fails for any other reason) shows up as an error.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "longspec_jax", "train", "infer", "benchmarks")
# What each package may import from the project, itself included: a layer sees only the layers below.
# benchmarks sits on top; nothing the product ships may depend on it.
ALLOWED = {
    "pallas_kernels": {"pallas_kernels"},
    "longspec_jax": {"longspec_jax", "pallas_kernels"},
    "train": {"train", "longspec_jax", "pallas_kernels"},
    "infer": {"infer", "train", "longspec_jax", "pallas_kernels"},
    "benchmarks": set(PACKAGES),
}


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages (a package is its __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def ancestors(name: str) -> list[str]:
    """'a.b.c' -> ['a', 'a.b']."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every dotted name an import statement anywhere in the module (functions included) can load."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules its imports execute (ancestor __init__s of other packages included)."""
    modules = project_modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        own_packages = set(ancestors(module)) | ({module} if path.name == "__init__.py" else set())
        edges = set()
        for name in imported_names(tree, module, path.name == "__init__.py"):
            # Outside the project, or `from module import attribute` (the module itself is a name too).
            if name not in modules:
                continue
            # A package this module is inside is already initialising: no edge to its __init__.
            edges.update(p for p in [*ancestors(name), name] if p not in own_packages and p in modules)
        edges.discard(module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
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


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete loop through the component's first module, for the failure message."""
    start = component[0]
    paths = {succ: [start, succ] for succ in graph[start] if succ in component}
    frontier = list(paths)
    while frontier and start not in paths:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node]):
                if succ in component and succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    nxt.append(succ)
        frontier = nxt
    return paths[start]


def test_the_graph_sees_lazy_imports_and_package_inits():
    """The reader itself: a function-level import and a cross-package __init__ both make edges."""
    graph = import_graph()
    assert "pallas_kernels.tree_attention" in graph["longspec_jax.attention"]
    assert "pallas_kernels" in graph["longspec_jax.attention"]  # pallas_kernels/__init__.py runs first
    assert "longspec_jax" not in graph["longspec_jax.attention"]  # its own package is already initialising
    assert "train.build_corpus" in graph["infer.build_eval_sets"]  # imported inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    loops = [" -> ".join(shortest_cycle(graph, c)) for c in cycles(graph)]
    assert not loops, "import cycles:\n" + "\n".join(loops)


def test_each_layer_imports_only_the_layers_below():
    wrong = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if target.split(".")[0] not in ALLOWED[module.split(".")[0]]
    ]
    assert not wrong, "\n".join(wrong)


FRESH_IMPORTS = sorted([name for name in project_modules() if name.startswith("pallas_kernels.")] + list(PACKAGES))


@pytest.mark.parametrize("module", FRESH_IMPORTS)
def test_imports_in_a_fresh_interpreter(module):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", f"import {module}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"`import {module}` failed:\n{result.stderr[-3000:]}"
