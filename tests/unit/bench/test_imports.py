"""The bench's own imports run one way: no cycle among `bench/` modules, counting function-level imports
(a lazy import is still a dependency a reader has to follow)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).parents[3] / "bench"


def bench_imports(path: Path) -> set[str]:
    """The `bench` modules `path` imports, at any level."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bench":
            if node.module == "bench":  # `from bench import document`
                found.update(f"bench.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "bench")
    return found


def graph() -> dict[str, set[str]]:
    modules = {f"bench.{p.stem}": p for p in BENCH.glob("*.py")}
    return {name: bench_imports(path) & set(modules) - {name} for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_lazy_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_bench_has_no_import_cycle() -> None:
    edges = graph()
    assert "bench.document" in edges and edges["bench.__main__"]  # the walk found the modules
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_the_product_never_imports_the_bench() -> None:
    """`bench/` sits above the package: it imports stagectl, stagectl never imports it."""
    product = Path(__file__).parents[3] / "stagectl"
    importers = [
        str(p.relative_to(product.parent)) for p in sorted(product.rglob("*.py")) if bench_imports(p)
    ]
    assert importers == []
    assert bench_imports(BENCH / "__main__.py")  # the walk sees a bench import where there is one


def test_the_page_renders_without_a_runner_or_torch() -> None:
    """BENCHMARKS.md comes from bench/results/ through `bench.document` and the `markdown*` modules: none of
    them imports a benchmark runner (`bench.bench_*`) or torch, at any level, so rendering the page (and its
    test) does not load torch and transformers for the GPU section's text."""
    renderers = [BENCH / "document.py", *sorted(BENCH.glob("markdown*.py"))]
    assert len(renderers) >= 5  # document, markdown, markdown_async, markdown_learning, markdown_gpu
    for path in renderers:
        tree = ast.parse(path.read_text())
        heavy = {
            name
            for node in ast.walk(tree)
            for name in (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if name.split(".")[0] in ("torch", "transformers")
        }
        runners = {m for m in bench_imports(path) if m.startswith("bench.bench_")}
        assert not heavy and not runners, f"{path.name} imports {sorted(heavy | runners)}"
