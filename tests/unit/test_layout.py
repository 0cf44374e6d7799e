"""The package's layout: no import cycle anywhere, and the benchmarks use public names only.

Tier: no device. The layers themselves are import-linter's contracts in pyproject.toml (``lint-imports``, run by
.ci/run); this checks what a contract cannot say: that no module, in any layer, takes part in an import cycle, with
imports inside functions counted as well. bench/ is outside the package and outside those contracts: its layers
(bench.cluster's cli > supervisor > network | control, bench.ddp_step above its models and its trace analysis)
are checked here.
"""

import ast
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter: pip install -e '.[test]'")

REPO = Path(__file__).resolve().parents[2]


def _cycles(graph, modules):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(start):
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start) & modules)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt) & modules))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return out


def _graph():
    import sys

    # `kernels` as the checkout has it (installed as ddp_triton.kernels), not Hugging Face's package of that name,
    # which Transformers imports when it is installed (the integration tier runs before this one).
    ours = REPO / "kernels"
    foreign = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "kernels"
               and ours not in Path(getattr(module, "__file__", None) or "/").parents}
    for name in foreign:
        del sys.modules[name]
    sys.path.insert(0, str(REPO))
    try:
        return grimp.build_graph("ddp_triton", "kernels", cache_dir=None)
    finally:
        sys.path.remove(str(REPO))
        sys.modules.update(foreign)


def test_no_import_cycle():
    graph = _graph()
    modules = {m for m in graph.modules if m.split(".")[0] in ("ddp_triton", "kernels")}
    assert "ddp_triton.runtime.state" in modules and "kernels.pack" in modules  # the graph is the package's
    # A package's __init__ that re-exports its modules, and a module of it that imports a sibling through the
    # package (`from . import nvml`), are one import in Python's eyes, not a cycle: such edges are left out.
    plain = {m for m in modules}

    class Edges:
        def find_modules_directly_imported_by(self, m):
            return {t for t in graph.find_modules_directly_imported_by(m) if not m.startswith(t + ".")}

    assert _cycles(Edges(), plain) == []


def test_cycle_finder_finds_one():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

    class Fake:
        def find_modules_directly_imported_by(self, m):
            return set(edges.get(m, ()))

    assert _cycles(Fake(), set(edges) | {"c"}) == [["a", "b", "c"]]


def test_bench_imports_public_names_only():
    """bench/ is outside the package: it uses what a user could, no ``_private`` name or module of ddp_triton."""
    private = []
    for path in sorted((REPO / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddp_triton"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("ddp_triton")]
            else:
                continue
            private += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                        if any(part.startswith("_") for part in n.split("."))]
    assert private == []


def test_bench_reads_no_private_attribute_of_ddp_triton():
    """Nor through a module it imported: ``torch_wire._native`` is as private as ``from ... import _native``. The
    one exception compiles the Triton kernels themselves for sm_90 and reads their launch settings."""
    reads_kernel_internals = {"bench/codegen.py"}
    private = []
    for path in sorted((REPO / "bench").rglob("*.py")):
        if str(path.relative_to(REPO)) in reads_kernel_internals:
            continue
        tree = ast.parse(path.read_text(), str(path))
        bound = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddp_triton"):
                bound |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                bound |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("ddp_triton")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                private.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert private == []


@pytest.fixture(scope="module")
def bench_graph():
    """The import graph of bench/ as the checkout has it (bench/ is not installed)."""
    import sys

    sys.path.insert(0, str(REPO))
    try:
        return grimp.build_graph("bench", cache_dir=None)
    finally:
        sys.path.remove(str(REPO))


@pytest.mark.parametrize("module, may_import", [
    pytest.param("bench.cluster.network", set(), id="cluster.network"),
    pytest.param("bench.cluster.control", set(), id="cluster.control"),
    pytest.param("bench.cluster.supervisor", {"bench.cluster.network", "bench.cluster.control"},
                 id="cluster.supervisor"),
    pytest.param("bench.cluster.cli", {"bench.cluster.supervisor", "bench.cluster.network"}, id="cluster.cli"),
    pytest.param("bench.cluster.__main__", {"bench.cluster.cli"}, id="cluster.__main__"),
    pytest.param("bench.ddp_models", set(), id="ddp_models"),
    pytest.param("bench.ddp_profile", {"bench.common"}, id="ddp_profile"),
    pytest.param("bench.ddp_trace", {"bench.common", "bench.ddp_profile"}, id="ddp_trace"),
    pytest.param("bench.listing", set(), id="listing"),
])
def test_bench_modules_import_only_the_layers_below(bench_graph, module, may_import):
    """bench.cluster in layers, cli > supervisor > network | control (a job's link-rate requests); the DDP step's
    models, its trace's recording and analysis, and the reading of compiled listings know nothing of the benchmark
    that uses them."""
    imported = {m for m in bench_graph.find_modules_directly_imported_by(module) if m.split(".")[0] == "bench"}
    assert imported <= may_import, sorted(imported - may_import)


def test_bench_has_no_import_cycle(bench_graph):
    """As for the package: a package's __init__ re-exporting its modules is no cycle."""

    class Edges:
        def find_modules_directly_imported_by(self, m):
            return {t for t in bench_graph.find_modules_directly_imported_by(m) if not m.startswith(t + ".")}

    modules = set(bench_graph.modules)
    assert {"bench.cluster.cli", "bench.ddp_step", "bench.ddp_profile"} <= modules
    assert _cycles(Edges(), modules) == []
