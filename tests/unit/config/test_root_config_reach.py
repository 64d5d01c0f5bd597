"""Components receive their part of the config, never the root (#44): outside `stagectl/config/` (which
resolves the plan) and `stagectl/cli/` (which asks for it), only the functions listed in `ROOT_TAKERS` take a
`StagectlConfig`, no class keeps one in a field, and nothing reads `custom.extra.rollout_matching`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[3] / "stagectl"
RESOLVERS = ("config", "cli")
# each one resolves the parts of the components it starts; at most 10 (the bar)
ROOT_TAKERS: set[str] = set()


def _outside_resolvers() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] not in RESOLVERS]


def _names_root(node: ast.expr | None) -> bool:
    return node is not None and "StagectlConfig" in ast.unparse(node)


def root_takers(paths: list[Path]) -> tuple[set[str], list[str]]:
    """(functions with a `StagectlConfig` parameter as `module:function`, class fields holding one)."""
    takers: set[str] = set()
    fields: list[str] = []
    for path in paths:
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                if any(_names_root(a.annotation) for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)):
                    takers.add(f"{module}:{node.name}")
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and _names_root(item.annotation):
                        fields.append(f"{module}:{node.name}.{ast.unparse(item.target)}")
    return takers, fields


def test_only_the_listed_functions_take_the_root_config() -> None:
    takers, fields = root_takers(_outside_resolvers())
    assert len(ROOT_TAKERS) <= 10
    assert sorted(takers - ROOT_TAKERS) == [], "give these components their part of the plan instead"
    assert sorted(ROOT_TAKERS - takers) == [], "no longer takes the root config: drop it from ROOT_TAKERS"
    assert fields == []


def test_rollout_matching_is_read_only_where_the_plan_is_resolved() -> None:
    """Messages may name the key; code outside the resolvers never reads the section."""
    readers = [
        f"{p.relative_to(ROOT.parent)}:{node.lineno}"
        for p in _outside_resolvers()
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and node.attr == "rollout_matching"
    ]
    assert readers == []


def test_the_checker_sees_a_root_taker(tmp_path: Path) -> None:
    pkg = tmp_path / "stagectl" / "learner"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text(
        "from stagectl.config import StagectlConfig\n"
        "def build(cfg: StagectlConfig, n: int) -> None: ...\n"
        "class Holder:\n    cfg: 'StagectlConfig'\n"
        "def fine(part: int) -> None: ...\n",
        encoding="utf-8",
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path / "stagectl"
    try:
        assert root_takers([pkg / "x.py"]) == (
            {"stagectl.learner.x:build"},
            ["stagectl.learner.x:Holder.cfg"],
        )
    finally:
        ROOT = saved
