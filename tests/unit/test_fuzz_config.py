"""Fuzzing `load_config`: random YAML, mutated example configs and random `--set` overrides always end
in a loaded config or a `ConfigError` whose every problem names a key path (never another exception).

Examples per property: 100 under `STAGECTL_FUZZ_PROFILE=full`, a tenth (at least 20) by default
(`tests.helpers.fuzz_examples`); `STAGECTL_FUZZ_EXAMPLES=5000` for a longer run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagectl.config import ConfigError, StagectlConfig, load_config
from tests.helpers import fuzz_examples

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples" / "tiny").glob("*.yaml"))
EXAMPLE_DATA = [yaml.safe_load(p.read_text()) for p in EXAMPLES]
SETTINGS = settings(
    max_examples=fuzz_examples(100),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

SECTION_KEYS = sorted(StagectlConfig.model_fields)
KEY_WORDS = st.sampled_from(
    [
        *SECTION_KEYS,
        "b_ratio",
        "schedule",
        "channel_b",
        "mode",
        "async",
        "max_steps",
        "output_dir",
        "name_or_path",
        "synthetic",
        "rollout_matching",
        "extra",
        "vllm",
        "server",
        "servers",
        "pattern",
        "rollout_buffer",
    ]
)
KEYS = st.one_of(KEY_WORDS, st.text(max_size=8), st.integers(-3, 3), st.booleans(), st.none())
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["1/3", "0.25", "async", "step", "vllm", "server", "full", "latest", "-1", "1e309"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=5)),
    max_leaves=25,
)


def check(raw_yaml: str, tmp_path: Path, overrides: list[str] | None = None) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(raw_yaml, encoding="utf-8")
    try:
        cfg = load_config(path, overrides or [], world_size=None)
    except ConfigError as exc:
        assert exc.problems, "a ConfigError must list at least one problem"
        for problem in exc.problems:
            assert problem.path and problem.message, problem
            assert str(exc).count(f"{problem.path}: ") >= 1
        return
    assert isinstance(cfg, StagectlConfig)


@SETTINGS
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_random_text(tmp_path: Path, text: str) -> None:
    check(text, tmp_path)


@SETTINGS
@given(data=st.dictionaries(KEYS, VALUES, max_size=6))
def test_random_structures(tmp_path: Path, data: dict[Any, Any]) -> None:
    check(yaml.safe_dump(data, allow_unicode=True), tmp_path)


def _leaves(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(node, dict):
        out = [prefix] if prefix else []
        for key, value in node.items():
            out += _leaves(value, (*prefix, key))
        return out
    return [prefix]


def _set(node: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _delete(node: Any, path: tuple[Any, ...]) -> None:
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]


MUTATION = st.tuples(
    st.sampled_from(["delete", "replace", "insert", "retype"]), st.integers(0, 10**6), KEYS, VALUES
)


@SETTINGS
@given(
    example=st.integers(0, len(EXAMPLE_DATA) - 1),
    mutations=st.lists(MUTATION, min_size=1, max_size=5),
    world_size=st.one_of(st.none(), st.integers(1, 4)),
)
def test_mutated_examples(
    tmp_path: Path, example: int, mutations: list[tuple[str, int, Any, Any]], world_size: int | None
) -> None:
    data = yaml.safe_load(yaml.safe_dump(EXAMPLE_DATA[example]))
    for op, where, key, value in mutations:
        leaves = _leaves(data)
        if not leaves:
            break
        path = leaves[where % len(leaves)]
        if op == "delete":
            _delete(data, path)
        elif op == "replace":
            _set(data, path, value)
        elif op == "insert":
            target = data
            for part in path[:-1]:
                target = target[part]
            target[key] = value
        else:  # retype: a section or value turned into a list / scalar
            _set(data, path, [value])
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    try:
        load_config(path, [], world_size=world_size)
    except ConfigError as exc:
        assert exc.problems and all(p.path and p.message for p in exc.problems)


OVERRIDE = st.one_of(
    st.text(max_size=30),
    st.builds(
        lambda key, value: f"{key}={value}",
        st.lists(KEY_WORDS, min_size=1, max_size=4).map(".".join),
        st.one_of(st.text(max_size=12), VALUES.map(lambda v: yaml.safe_dump(v, default_flow_style=True))),
    ),
)


@SETTINGS
@given(example=st.integers(0, len(EXAMPLE_DATA) - 1), overrides=st.lists(OVERRIDE, max_size=4))
def test_random_overrides(tmp_path: Path, example: int, overrides: list[str]) -> None:
    check(yaml.safe_dump(EXAMPLE_DATA[example]), tmp_path, overrides)


def test_the_unmutated_examples_load() -> None:
    """The fuzzers start from valid configs (a mutation that changes nothing must load)."""
    for path in EXAMPLES:
        assert isinstance(load_config(path, [], world_size=None), StagectlConfig), path
