"""The package's import graph, read from the source (imports inside functions count too).

- no import circles among the modules of bucketserve/;
- no import from a lower layer back up: buckets, kernels < models < engine < server, bench
  (docs/architecture.md states the order); bench needs nothing above buckets;
- no production module imports a test fake or reads a test switch from the environment.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "bucketserve"

LAYERS = {"buckets": 0, "kernels": 0, "models": 1, "engine": 2, "server": 3, "bench": 3}
# Top-level modules of the package that are entry points for other tools (`serve run
# bucketserve.deploy:build_app`): above every layer.
ENTRY_POINTS = {"bucketserve.deploy": 4}
# the fakes the tests and benchmarks pass in, and the one module that builds them from flags
FAKES = {"bucketserve.engine.fake_core", "bucketserve.engine.fake_runner"}
SUPPORT = FAKES | {"bucketserve.bench.hooks"}
TEST_SWITCHES = ("BUCKETSERVE_FAULTS", "BUCKETSERVE_FAKE_CORE", "BUCKETSERVE_FAKE_RUNNER",
                 "BUCKETSERVE_CORE_PROFILE")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    is_package = SOURCES[importer].name == "__init__.py"
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str) -> set[str]:
    """The bucketserve modules `name` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(SOURCES[name].read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = resolve(name, node)
            # `from pkg import sub` imports the submodule where one has that name
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in SOURCES else module
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in SOURCES:
                target = target.rpartition(".")[0]  # `import a.b.c` of a name inside a.b
            if target.startswith("bucketserve") and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name) for name in SOURCES}


def layer(name: str) -> int:
    if name in ENTRY_POINTS:
        return ENTRY_POINTS[name]
    parts = name.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 1 else 0


def test_the_graph_is_read():
    # a sanity check of the reader: edges it must find (a module-level and a function-level one)
    assert "bucketserve.engine.scheduler" in GRAPH["bucketserve.engine.llm_engine"]
    assert "bucketserve.bench.cli" in GRAPH["bucketserve.server.cli"]


def cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
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
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles() == []


def test_no_import_climbs_a_layer():
    climbs = [f"{a} -> {b}" for a, targets in GRAPH.items() for b in sorted(targets)
              if layer(b) > layer(a)]
    assert climbs == []


def test_bench_needs_nothing_above_buckets():
    bench = [f"{a} -> {b}" for a, targets in GRAPH.items() if a.startswith("bucketserve.bench")
             for b in sorted(targets)
             if not b.startswith(("bucketserve.bench", "bucketserve.buckets"))
             and b != "bucketserve" and a not in SUPPORT]
    assert bench == []


@pytest.mark.parametrize("name", sorted(set(SOURCES) - SUPPORT))
def test_production_code_imports_no_fake_and_reads_no_test_switch(name):
    assert not GRAPH[name] & FAKES
    text = SOURCES[name].read_text()
    assert [s for s in TEST_SWITCHES if s in text] == []
