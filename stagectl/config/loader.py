"""`load_config`: YAML -> `--set` overrides -> validation -> `StagectlConfig`, or a `ConfigError`
listing every problem as a dotted key path plus what to do."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from stagectl.config.root import Problem, StagectlConfig
from stagectl.config.schema_problems import model_types, schema_problems
from stagectl.config.training import LaunchConfig
from stagectl.config.validators import run_validators

# Keys that existed once and were removed or renamed: their presence fails with migration guidance
# instead of a generic "unknown key".
REMOVED_KEYS: dict[str, str] = {
    "stage2_ab.schedule.pattern": (
        "removed: the channel schedule is now a ratio; replace the pattern with "
        "stage2_ab.schedule.b_ratio (the fraction of Channel-B optimizer steps, e.g. 0.25)"
    ),
    "custom.extra.rollout_matching.rollout_buffer": (
        "removed: the rollout buffer is replaced by the async prefetcher; delete it and use "
        "stage2_ab.channel_b.mode: async with stage2_ab.channel_b.async.{queue_limit, prefetch_target_packs}"
    ),
    "runner.test_engine": (
        "removed: the rule engine has no fault knobs any more (the test suite injects its faults); "
        "delete runner.test_engine and use runner.engine: rules for a dry run"
    ),
    "rollout_server.slow_infer_ms": (
        "removed: it was a test knob; the test suite slows the server down from outside"
    ),
    "guidance.reset_on_rerun": (
        "removed: a run directory that holds a run is refused unless you say what you want: "
        "stagectl stage-b --resume continues from its guidance, --overwrite moves it aside and starts "
        "from guidance.path"
    ),
    "launch.dist_timeout_s": (
        "removed: collective deadlines are per phase now; use launch.watchdog.step_s (and "
        "launch.watchdog.{startup_s, weight_sync_s, checkpoint_s, eval_s, shutdown_s})"
    ),
}


class ConfigError(ValueError):
    """Every problem of a config, each as `dotted.key.path: what is wrong and what to do`."""

    def __init__(self, problems: Sequence[Problem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        head = f"invalid config {source}" if source else "invalid config"
        lines = [f"{head} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: Iterable[str] = (),
    world_size: int | None = None,
    *,
    trains: bool = True,
) -> StagectlConfig:
    """Read YAML (or start empty when `path` is None), apply `key=value` overrides, validate.

    The world size used by the cross-section rules is `world_size` if given, else `$WORLD_SIZE`,
    else `launch.nproc_per_node x launch.nnodes`. `trains` False (`stagectl eval`, whose ranks only shard
    images): the rules that judge the training world (`validators.TRAINING_WORLD_RULES`) are skipped, so
    no world size is read.
    """
    source = str(path) if path is not None else "<overrides>"
    raw = _read_yaml(Path(path)) if path is not None else {}
    problems: list[Problem] = []
    for override in overrides:
        try:
            apply_override(raw, override)
        except ValueError as exc:
            problems.append(Problem(_override_key(override), str(exc)))
    problems += _pop_removed_keys(raw)
    _empty_sections_to_mappings(raw, StagectlConfig)
    cfg, invalid = _validate_schema(raw)
    problems += invalid
    if cfg is not None:
        # a key (or a whole section, when its own rule failed) that was dropped reads as its default in the
        # cross-section rules: their problems at or under it, or judged by it (`Problem.about`), would be
        # about values the user did not write
        bad_paths = {p.path for p in invalid}
        cross = run_validators(cfg, _world_size(cfg, world_size, problems) if trains else None)
        problems += [p for p in cross if not any(_under(key, bad_paths) for key in (p.path, *p.about))]
    if problems:
        raise ConfigError(problems, source)
    assert cfg is not None
    return cfg


def _under(path: str, prefixes: set[str]) -> bool:
    """`path` is one of `prefixes` or a key inside one (`training.mixed_precision` under `training`)."""
    return any(path == prefix or path.startswith(f"{prefix}.") for prefix in prefixes)


def _validate_schema(raw: dict[str, Any]) -> tuple[StagectlConfig | None, list[Problem]]:
    """Validate; on schema errors, drop the offending keys and retry so the cross-section rules can
    still run on the rest and every problem is reported in one go."""
    problems: list[Problem] = []
    attempt = copy.deepcopy(raw)
    dropped: set[tuple[int | str, ...]] = set()  # a required key dropped here is not also "required; set it"
    for _ in range(4):
        try:
            return StagectlConfig.model_validate(attempt), problems
        except ValidationError as exc:
            errors = exc.errors()
            new = [
                problem
                for problem, err in zip(schema_problems(exc), errors, strict=True)
                if not (err["type"] == "missing" and tuple(err["loc"]) in dropped)
            ]
            problems += [p for p in new if p not in problems]
            deleted = next((tuple(err["loc"]) for err in errors if _delete_path(attempt, err["loc"])), None)
            if deleted is None:
                break
            dropped.add(deleted)
    return None, problems


def _child(node: Any, part: int | str) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and part < len(node):
        return node[part]
    return None


def _delete_path(raw: Any, loc: tuple[int | str, ...]) -> bool:
    node = raw
    for part in loc[:-1]:
        node = _child(node, part)
        if node is None:
            return False
    if isinstance(node, dict) and loc and loc[-1] in node:
        del node[loc[-1]]
        return True
    return False


def effective_world_size(cfg: StagectlConfig, world_size: int | None = None) -> int:
    """The world size the config runs with (explicit > $WORLD_SIZE > launch section)."""
    return _world_size(cfg, world_size, [])


class WorldSizeConflict(ValueError):
    """`--nproc` and `--world-size` given together name two different worlds (a usage error)."""


def nproc_world_size(
    path: str | os.PathLike[str], overrides: Iterable[str], nproc: int, world_size: int | None = None
) -> int:
    """The world size `--nproc N` makes, as train-ab launches it: N ranks on each of `launch.nnodes` nodes
    (read from `path` with `overrides`, as the command applies them). A `world_size` given too (`--world-size`)
    must be that same world, else `WorldSizeConflict` naming both: validating either one silently would check
    a run the user did not describe. A config that does not load gives N (or `world_size`): the command's
    own load reports its problems."""
    launch = _launch(path, overrides)
    if launch is None:
        return nproc if world_size is None else world_size
    nnodes = launch.nnodes
    if world_size is not None and world_size != nproc * nnodes:
        nodes = f"{nnodes} node{'s' if nnodes != 1 else ''}"
        raise WorldSizeConflict(
            f"--nproc {nproc} and --world-size {world_size} disagree: --nproc {nproc} on {nodes} "
            f"(launch.nnodes) is world size {nproc * nnodes}; give one of them"
        )
    return nproc * nnodes


def launch_world_size(path: str | os.PathLike[str], overrides: Iterable[str]) -> int | None:
    """The world a launcher starts: `launch.nproc_per_node` ranks on each of `launch.nnodes` nodes (read from
    `path` with `overrides`), whatever `$WORLD_SIZE` its own environment holds (a stale one from another job
    would validate and plan a world torchrun does not start). None when the config does not load: the
    command's own load reports its problems."""
    launch = _launch(path, overrides)
    return None if launch is None else launch.nproc_per_node * launch.nnodes


def _launch(path: str | os.PathLike[str], overrides: Iterable[str]) -> LaunchConfig | None:
    """The launch section of `path` with `overrides`, or None when the config does not load."""
    try:
        return load_config(path, overrides, trains=False).launch
    except ConfigError:
        return None


def _world_size(cfg: StagectlConfig, explicit: int | None, problems: list[Problem]) -> int:
    if explicit is not None:
        return explicit
    env = os.environ.get("WORLD_SIZE")
    if env:
        try:
            return int(env)
        except ValueError:
            problems.append(Problem("WORLD_SIZE", f"environment variable is not an integer: {env!r}"))
    return cfg.launch.nproc_per_node * cfg.launch.nnodes


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key written twice in one mapping: YAML keeps the last one silently, so a
    second `training:` block at the end of a file would drop every key of the first. Keys that a merge (`<<:
    *anchor`) brings in may be overridden, as YAML intends.

    The check runs on a mapping's keys as written, the first time the mapping is flattened: PyYAML flattens
    an anchored mapping in place (its merged keys joined to its own) when a merge that names it comes first,
    so a check at its own construction would see a merged key and its override as one key written twice."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()  # ids of the mapping nodes whose keys were checked

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if id(node) not in self._checked:
            self._checked.add(id(node))
            self._refuse_repeated_keys(node)
        super().flatten_mapping(node)

    def _refuse_repeated_keys(self, node: yaml.MappingNode) -> None:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is written twice in one mapping (first at line {seen[key] + 1}); YAML would keep "
                    "only the last, dropping the first one's value without a word: merge them into one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line


def _safe_load_unique_keys(text: str) -> Any:
    """`yaml.safe_load(text)` that refuses a key written twice: `_UniqueKeyLoader` is a `SafeLoader`, so no
    tag builds an arbitrary object (what `yaml.safe_load` itself does with its own loader)."""
    loader = _UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([Problem("<file>", f"config file not found: {path}")], str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Problem("<file>", f"cannot read {path}: {exc}")], str(path)) from None
    try:
        data = _safe_load_unique_keys(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError([Problem("<yaml>", f"not valid YAML{where}: {problem}")], str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [Problem("<root>", f"the top level must be a mapping of sections, got {type(data).__name__}")],
            str(path),
        )
    return data


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].strip() or "<override>"


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply `a.b.c=value` to the raw mapping; the value is parsed as YAML (`1e-5`, `true`, `[1, 2]`)."""
    if "=" not in override:
        raise ValueError(f"override {override!r} must look like key.path=value")
    key, _, text = override.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ValueError(f"override key {key!r} has an empty segment")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    node: dict[str, Any] = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"cannot set {key}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _empty_sections_to_mappings(raw: dict[str, Any], model: type[BaseModel]) -> None:
    """A section key with nothing under it (`schedule:` after its last key was deleted) is YAML null; read it
    as an empty section, so the message is about the key that is missing, not "should be a dictionary".
    Only for sections of one model type that cannot be null (where null means "no such section", or the
    section is a union, the value is left alone)."""
    fields = {field.alias or name: field for name, field in model.model_fields.items()}
    fields.update(model.model_fields)
    for key, value in raw.items():
        field = fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue
        types = model_types(field.annotation)
        if len(types) != 1:
            continue
        if value is None and type(None) not in getattr(field.annotation, "__args__", ()):
            raw[key] = value = {}
        if isinstance(value, dict):
            _empty_sections_to_mappings(value, types[0])


def _pop_removed_keys(raw: dict[str, Any]) -> list[Problem]:
    problems = []
    for dotted, message in REMOVED_KEYS.items():
        *parents, leaf = dotted.split(".")
        node: Any = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            del node[leaf]
            problems.append(Problem(dotted, message))
    return problems


def to_plain(cfg: StagectlConfig) -> Mapping[str, Any]:
    """The resolved config as plain JSON-able data (aliases as in YAML)."""
    return cfg.model_dump(mode="json", by_alias=True)
