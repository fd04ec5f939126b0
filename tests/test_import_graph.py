"""No import circles in kda_compile: every module of the package (kda_compile/, ops/ and passes/, as installed
under kda_compile.ops / kda_compile.passes) is parsed with ast, and an import at module level or inside a
function both count as an edge. A circle fails the test with its modules named in order.

``from package import name`` is an edge to the module ``package.name`` when that is a module of ours, else to
``package`` itself; an import of something outside kda_compile (transformers, fla, matplotlib) is no edge. A
module is not given an edge to the packages above it: importing ``kda_compile.passes.report`` runs
``kda_compile/__init__.py`` first, but that is Python's doing, not an import the module wrote."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"kda_compile": ROOT / "kda_compile", "kda_compile.ops": ROOT / "ops", "kda_compile.passes": ROOT / "passes"}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ours that ``name`` (at ``path``) imports, anywhere in its code."""

    def ours(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges.update(ours(alias.name) for alias in node.names if alias.name.startswith("kda_compile"))
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            if module.split(".")[0] != "kda_compile":
                continue
            for alias in node.names:
                full = f"{module}.{alias.name}"
                edges.add(full if full in known else ours(module))
    edges.discard(None)
    edges.discard(name)
    return edges


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return [circle(graph, group) for group in groups]


def circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A path from the group's first module back to itself, within the group (breadth-first: a shortest one)."""
    first = min(group)
    paths = {first: [first]}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == first:
                    return paths[node] + [first]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle in {sorted(group)}")


def test_the_graph_sees_every_package():
    known = modules()
    assert {"kda_compile", "kda_compile.ops", "kda_compile.passes", "kda_compile.bench"} <= set(known)
    edges = imports("kda_compile.passes.manager", known["kda_compile.passes.manager"], known)
    assert "kda_compile.passes.rewrite" in edges and "kda_compile.config" in edges


def test_a_circle_is_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    found = [" -> ".join(c) for c in cycles(graph)]
    assert not found, "import circles:\n  " + "\n  ".join(found)


def test_imports_inside_functions_count(tmp_path):
    path = tmp_path / "late.py"
    path.write_text("import os\n\n\ndef f():\n    from kda_compile.passes import report\n    import transformers\n")
    known = {"kda_compile.late": path, "kda_compile.passes": path, "kda_compile.passes.report": path}
    assert imports("kda_compile.late", path, known) == {"kda_compile.passes.report"}


def _op_modules_reached(path: pathlib.Path) -> set[str]:
    """The ``kda_compile.ops...`` modules a file imports from (``from M import ...`` / ``import M``)."""
    reached = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kda_compile.ops"):
            reached.add(node.module)
        elif isinstance(node, ast.Import):
            reached.update(a.name for a in node.names if a.name.startswith("kda_compile.ops"))
    return reached


def test_passes_use_ops_only_through_their_public_packages():
    """The layering rule: a rewrite reaches an op through ``kda_compile.ops`` or an op's package
    (``kda_compile.ops.attention``), never through a module inside it or a private module (``_common``)."""
    known = modules()
    op_packages = {name for name, path in known.items()
                   if name.count(".") == 2 and name.startswith("kda_compile.ops.") and path.name == "__init__.py"}
    public = {"kda_compile.ops"} | {name for name in op_packages if not name.rpartition(".")[2].startswith("_")}
    offending = {f"{path.relative_to(ROOT)}: {module}" for name, path in known.items()
                 if name.startswith("kda_compile.passes") for module in _op_modules_reached(path)
                 if module not in public}
    assert not offending, "passes importing inside an op:\n  " + "\n  ".join(sorted(offending))
