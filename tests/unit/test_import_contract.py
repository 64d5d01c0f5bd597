"""Dependencies point one way. Every `stagectl` import (module level, function level and type-only alike)
must go from a layer to the same package or to a lower layer:

    entry   cli, __main__, torchrun, launch, doctor (the preflight probes every role)
    role    learner, stage_b, report, server (the rollout server)
    core    inference (the client), engines, weightsync (both sides of every transport), wire (the
            code every process shares), packing, collate, detection, data, models, dist, schedule, watchdog,
            files, console, seeds, cache, memory, placement, timing, metric_keys, templating
    config  config

A unit is a top package (or top module) under `stagectl`, nothing more. Inside `core`, packages may use
each other but never in a cycle; inside `role`, one role never imports another (the learner does not
reach into the rollout server). `python -m tests.unit.test_import_contract` prints the package-level map.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).parents[2] / "stagectl"

LAYERS = {
    "entry": {"cli", "__main__", "torchrun", "launch", "doctor"},
    "role": {"learner", "stage_b", "report", "server"},
    "core": {
        "inference",
        "engines",
        "weightsync",
        "wire",
        "packing",
        "detection",
        "evaluation",
        "data",
        "models",
        "dist",
        "schedule",
        "watchdog",
        "files",
        "rundir",
        "collate",
        "console",
        "seeds",
        "cache",
        "memory",
        "placement",
        "timing",
        "metric_keys",
        "templating",
        "stopping",
        "__init__",
    },
    "config": {"config"},
}
RANK = {"entry": 3, "role": 2, "core": 1, "config": 0}


def unit_of(module: str) -> str:
    """The unit a module belongs to: its top package (or top module) under stagectl."""
    return (module.split(".")[1:] or ["__init__"])[0]


def layer_of(unit: str) -> str:
    for layer, units in LAYERS.items():
        if unit in units:
            return layer
    raise AssertionError(f"stagectl.{unit}: not in any layer; add it to LAYERS in {__file__}")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every stagectl module `path` imports (`from stagectl import dist` counts as `stagectl.dist`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "stagectl"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "stagectl":
                found |= {f"stagectl.{a.name}" for a in node.names}
            elif node.module.startswith("stagectl."):
                found.add(node.module)
    return found


def module_graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}


def unit_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for source, targets in graph.items():
        for target in targets:
            a, b = unit_of(source), unit_of(target)
            if a != b:
                edges[(a, b)].append(f"{source} -> {target}")
    return edges


def uphill_edges(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for (a, b), examples in sorted(unit_edges(graph).items()):
        la, lb = layer_of(a), layer_of(b)
        if RANK[lb] > RANK[la] or la == lb == "role":
            bad.append(f"{a} ({la}) -> {b} ({lb}): {examples[0]}")
    return bad


def cycles(nodes: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(nodes.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return found


def test_no_import_runs_uphill() -> None:
    assert uphill_edges(module_graph()) == []


def test_no_cycle_between_packages() -> None:
    units: dict[str, set[str]] = defaultdict(set)
    for a, b in unit_edges(module_graph()):
        units[a].add(b)
    assert cycles(units) == []


def test_inference_callers_build_no_weight_machinery() -> None:
    """The inference client is inference only: Stage-B, eval and the client itself never reach weightsync."""
    graph = module_graph()
    for module in ("stagectl.inference", "stagectl.stage_b", "stagectl.evaluation"):
        reached = _closure(graph, {m for m in graph if m == module or m.startswith(module + ".")})
        assert not {m for m in reached if m.startswith("stagectl.weightsync")}, module


def test_weight_sync_builds_no_inference_client_and_no_engine() -> None:
    """Weight sync reads a server's answers through the wire code (`wire.http`), never the client, and
    writes into an engine through its own `gate.WeightTarget`, never an engine module."""
    graph = module_graph()
    reached = _closure(graph, {m for m in graph if m.startswith("stagectl.weightsync")})
    assert not {m for m in reached if m.startswith(("stagectl.inference", "stagectl.engines"))}


def test_the_wire_code_reaches_no_side() -> None:
    """Every process shares `wire`: it reaches neither the client, the engines, weight sync nor the server."""
    graph = module_graph()
    reached = _closure(graph, {m for m in graph if m.startswith("stagectl.wire")})
    sides = ("stagectl.inference", "stagectl.engines", "stagectl.weightsync", "stagectl.server")
    assert not {m for m in reached if m.startswith(sides)}


def _closure(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    seen, todo = set(start), list(start)
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_cycle_between_modules() -> None:
    graph = module_graph()
    # a package's __init__ re-exporting its own modules is not a cycle of logic
    edges = {m: {t for t in ts if not m.startswith(t + ".") and t in graph} for m, ts in graph.items()}
    assert cycles(edges) == []


def test_the_checker_sees_an_uphill_edge_and_a_cycle() -> None:
    graph = {"stagectl.schedule": {"stagectl.learner.loop"}, "stagectl.learner.loop": {"stagectl.schedule"}}
    assert uphill_edges(graph) == [
        "schedule (core) -> learner (role): stagectl.schedule -> stagectl.learner.loop"
    ]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert uphill_edges({"stagectl.learner.x": {"stagectl.server.service"}})  # role -> another role
    # a unit is the top package, whatever the depth of the module
    assert unit_of("stagectl.engines.vllm") == unit_of("stagectl.engines") == "engines"
    assert uphill_edges({"stagectl.weightsync.x": {"stagectl.server.app"}})  # core -> role
    assert uphill_edges({"stagectl.wire.x": {"stagectl.config.y"}}) == []  # core -> config


def main() -> None:
    for (a, b), examples in sorted(unit_edges(module_graph()).items()):
        print(f"{a:15s} -> {b:15s} {len(examples):3d}  ({layer_of(a)} -> {layer_of(b)})")


if __name__ == "__main__":
    main()
