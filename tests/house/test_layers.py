"""The tree shows the layers: no import cycles, and no import from a layer above.

Read with the ast module, so nothing is imported. Every import counts, including those inside
functions (a lazy import defers a cycle, it does not remove it), except ``if TYPE_CHECKING:``
blocks. Importing ``a.b.c`` runs ``a`` and ``a.b`` too, so it is an edge to each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support import REPO

ROOTS = {"kvdb": REPO / "kvdb"}
FRONT_ENDS = ("kvdb.cli", "kvdb.server", "kvdb.mcp")

# Lower layers never import higher ones. A module takes the rank of its longest listed prefix.
RANKS = {
    "kvdb.errors": 0,
    "kvdb.user_cache": 0,
    "kvdb.files": 0,
    "kvdb.recent": 0,
    "kvdb.codecs": 1,
    "kvdb.sealing": 1,
    "kvdb.transcripts": 1,
    "kvdb.storage": 2,
    # alembic's environment (run by kvdb.storage.migrate), revisions and frozen rules (a lake's upgrade reads them too)
    "kvdb.migrations": 2,
    "kvdb.model": 3,
    "kvdb.index": 4,
    "kvdb.tiers": 4,
    "kvdb.records": 4,
    "kvdb.services": 5,
    "kvdb.archive": 6,
    "kvdb": 6,  # the public __init__
    "kvdb.serving": 7,
    "kvdb.cli": 8,
    "kvdb.server": 8,
    "kvdb.mcp": 8,
}
# Kernels: arrays in, arrays out. They may call the integer forward pass, a kernel of the model
# package, and seal the files they write (kvdb.sealing: bytes in, bytes out, under the archive's
# key), but never storage, indexes or services.
KERNELS = ("kvdb.codecs", "kvdb.model.integer_lm", "kvdb.model.integer_kernel", "kvdb.index.sidecar")
KERNEL_MAY_IMPORT = (
    "kvdb.errors",
    "kvdb.files",
    "kvdb.sealing",
    "kvdb.codecs",
    "kvdb.model.integer_lm",
    "kvdb.model.integer_kernel",
    "kvdb.model._integer_kernel",
)


def modules() -> dict[str, Path]:
    found = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()

    def add(module: str) -> None:
        parts = module.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known)

    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            add(base)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    add(f"{base}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
    return {m for m in out if m != name and not name.startswith(m + ".")}  # a module's own packages run first anyway


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def rank(module: str) -> int:
    prefix = max((p for p in RANKS if module == p or module.startswith(p + ".")), key=len)
    return RANKS[prefix]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_there_are_no_import_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_layer_imports_one_above_it():
    upward = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets if rank(b) > rank(a))
    assert upward == []


def test_kernels_import_only_kernels():
    found = sorted(
        f"{a} -> {b}"
        for a, targets in graph().items()
        if a.startswith(KERNELS)
        for b in targets
        if b.startswith("kvdb") and not b.startswith(KERNEL_MAY_IMPORT) and b != "kvdb.model"
    )
    assert found == []


def test_the_library_knows_nothing_of_its_front_ends():
    """kvdb/ outside its front ends (the CLI, the HTTP server, the MCP server) imports neither
    them nor what they are built on: they parse, call the library and format."""
    outside = ("click", "fastapi", "starlette", "uvicorn", "mcp")
    found = []
    for name, path in modules().items():
        if name.startswith(FRONT_ENDS):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{name} -> {n}" for n in names if n.split(".")[0] in outside or n.startswith(FRONT_ENDS)]
    assert found == []


def test_the_front_ends_live_in_the_package():
    """One package tree: every module is imported by the name of its folder under kvdb/."""
    names = modules()
    assert (
        all(any(name == f or name.startswith(f + ".") for name in names) for f in FRONT_ENDS)
        and "kvdb.migrations.versions" in names
    )


def test_kvdbs_tests_import_no_benchmark():
    """A benchmark may change or leave the tree (a study, kept at a tag) without a test of kvdb
    breaking: the benchmarks' own tests live in benchmarks/tests/."""
    benchmarks = {path.stem for path in (REPO / "benchmarks").glob("*.py")}
    found = []
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else []
            )
            found += [f"{path.relative_to(REPO)}: {name}" for name in names if name.split(".")[0] in benchmarks]
    assert benchmarks and not found
