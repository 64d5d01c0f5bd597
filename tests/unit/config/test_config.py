"""The config model: fail-fast rules (each with its guidance), unknown keys, overrides, world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stagectl.config import ConfigError, StagectlConfig, apply_override, load_config, resolve_config

BASE = {
    "data": {"synthetic": {"num_samples": 8}},
    "stage2_ab": {"schedule": {"b_ratio": 0.25}},
}
ASYNC = {
    "data": {"synthetic": {"num_samples": 8}},
    "custom": {
        "extra": {
            "rollout_matching": {
                "rollout_backend": "vllm",
                "vllm": {"mode": "server", "server": {"servers": [{"base_url": "http://127.0.0.1:8000"}]}},
            }
        }
    },
    "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "async"}},
}


def write(tmp_path: Path, data: dict, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def problems_of(tmp_path: Path, data: dict, *overrides: str, world_size: int | None = None) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data), overrides, world_size=world_size)
    return {p.path: p.message for p in info.value.problems}


def test_valid_config_loads(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE))
    assert isinstance(cfg, StagectlConfig)
    assert cfg.stage2_ab is not None and cfg.stage2_ab.schedule.b_ratio == 0.25
    assert cfg.packing_length == cfg.global_max_length


def test_pattern_removed_names_b_ratio(tmp_path: Path) -> None:
    data = {**BASE, "stage2_ab": {"schedule": {"pattern": ["A", "B"], "b_ratio": 0.5}}}
    probs = problems_of(tmp_path, data)
    assert "stage2_ab.schedule.b_ratio" in probs["stage2_ab.schedule.pattern"]


def test_channel_b_target_keys(tmp_path: Path) -> None:
    cb = {"target": "clean_prefix", "insertion_order": "sorted", "duplicate_iou_threshold": 0.5}
    cfg = load_config(write(tmp_path, {**BASE, "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": cb}}))
    assert cfg.stage2_ab is not None
    got = cfg.stage2_ab.channel_b
    assert (got.target, got.insertion_order, got.duplicate_iou_threshold) == ("clean_prefix", "sorted", 0.5)
    default = load_config(write(tmp_path, BASE))
    assert default.stage2_ab is not None and default.stage2_ab.channel_b.target == "raw_prefix"
    decoding = default.custom.extra.rollout_matching.decoding
    assert (decoding.temperature, decoding.top_p) == (0.01, 0.95)  # the Channel-B recommendation
    probs = problems_of(tmp_path, BASE, "stage2_ab.channel_b.insertion_order=sorted")
    assert "target: clean_prefix" in probs["stage2_ab.channel_b.insertion_order"]
    probs = problems_of(tmp_path, BASE, "stage2_ab.channel_b.target=clean")
    assert "stage2_ab.channel_b.target" in probs
    probs = problems_of(tmp_path, BASE, "stage2_ab.channel_b.duplicate_iou_threshold=0")
    assert "stage2_ab.channel_b.duplicate_iou_threshold" in probs


def test_channel_b_label_and_loss_parity_keys(tmp_path: Path) -> None:
    default = load_config(write(tmp_path, BASE))
    assert default.stage2_ab is not None
    s2, cb = default.stage2_ab, default.stage2_ab.channel_b
    # the defaults are the behaviour before these keys
    assert (cb.desc_ce_weight_matched, cb.mask_correct_matched_desc) == (0.0, True)
    assert (cb.match.assignment, cb.match.desc_gated) == ("hungarian", False)
    assert (s2.bbox_smoothl1_beta, s2.coord_ce_vocab) == (0.05, "full")
    cfg = load_config(
        write(tmp_path, BASE),
        [
            "stage2_ab.channel_b.target=reordered_gt",
            "stage2_ab.channel_b.desc_ce_weight_matched=0.3",
            "stage2_ab.channel_b.mask_correct_matched_desc=false",
            "stage2_ab.channel_b.match.assignment=greedy_iou",
            "stage2_ab.channel_b.match.desc_gated=true",
            "stage2_ab.bbox_smoothl1_beta=1.0",
            "stage2_ab.coord_ce_vocab=coord",
        ],
    )
    assert cfg.stage2_ab is not None
    s2, cb = cfg.stage2_ab, cfg.stage2_ab.channel_b
    assert (cb.target, cb.desc_ce_weight_matched, cb.mask_correct_matched_desc) == (
        "reordered_gt",
        0.3,
        False,
    )
    assert (cb.match.assignment, cb.match.desc_gated) == ("greedy_iou", True)
    assert (s2.bbox_smoothl1_beta, s2.coord_ce_vocab) == (1.0, "coord")
    for override, path in [
        ("stage2_ab.channel_b.desc_ce_weight_matched=-0.1", "stage2_ab.channel_b.desc_ce_weight_matched"),
        ("stage2_ab.channel_b.match.assignment=auction", "stage2_ab.channel_b.match.assignment"),
        ("stage2_ab.channel_b.match.gated=true", "stage2_ab.channel_b.match.gated"),
        ("stage2_ab.bbox_smoothl1_beta=0", "stage2_ab.bbox_smoothl1_beta"),
        ("stage2_ab.coord_ce_vocab=coords", "stage2_ab.coord_ce_vocab"),
    ]:
        assert path in problems_of(tmp_path, BASE, override), override
    probs = problems_of(
        tmp_path,
        BASE,
        "stage2_ab.channel_b.target=reordered_gt",
        "stage2_ab.channel_b.insertion_order=sorted",
    )
    assert "sorted would make it Channel-A" in probs["stage2_ab.channel_b.insertion_order"]


def test_b_ratio_missing(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, {"data": BASE["data"], "stage2_ab": {"schedule": {}}})
    msg = probs["stage2_ab.schedule.b_ratio"]
    assert "0.0 = A only" in msg and "1.0 = B only" in msg


def test_b_ratio_missing_when_section_absent(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, {"data": BASE["data"], "custom": {"trainer_variant": "stage2_ab_training"}})
    assert "stage2_ab.schedule.b_ratio" in probs


@pytest.mark.parametrize("ratio", [-0.1, 1.5, "3/2"])
def test_b_ratio_out_of_range(tmp_path: Path, ratio: object) -> None:
    probs = problems_of(tmp_path, {**BASE, "stage2_ab": {"schedule": {"b_ratio": ratio}}})
    assert "[0, 1]" in probs["stage2_ab.schedule.b_ratio"]


def test_b_ratio_fraction_text(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, {**BASE, "stage2_ab": {"schedule": {"b_ratio": "1/3"}}}))
    assert cfg.stage2_ab is not None and cfg.stage2_ab.schedule.b_ratio == "1/3"


@pytest.mark.parametrize("source", ["arg", "env", "launch"])
def test_step_mode_multi_rank_fails_with_async_guidance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    data = dict(BASE)
    kwargs: dict = {}
    if source == "arg":
        kwargs["world_size"] = 2
    elif source == "env":
        monkeypatch.setenv("WORLD_SIZE", "2")
    else:
        data = {**BASE, "launch": {"nproc_per_node": 2}}
    probs = problems_of(tmp_path, data, **kwargs)
    assert "stage2_ab.channel_b.mode: async" in probs["stage2_ab.channel_b.mode"]


def test_step_mode_multi_rank_allowed_for_a_only(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, {**BASE, "stage2_ab": {"schedule": {"b_ratio": 0.0}}}), world_size=4)
    assert resolve_config(cfg, 4).world_size == 4


def test_async_requires_server_rollouts(tmp_path: Path) -> None:
    data = {**BASE, "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "async"}}}
    probs = problems_of(tmp_path, data)
    assert "rollout_backend: vllm" in probs["custom.extra.rollout_matching.rollout_backend"]


def test_adapter_sync_needs_an_adapter_and_http(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, ASYNC, "custom.extra.rollout_matching.vllm.sync.mode=adapter")
    assert "model.adapter, which is not set" in probs["custom.extra.rollout_matching.vllm.sync.mode"]
    probs = problems_of(
        tmp_path,
        ASYNC,
        "custom.extra.rollout_matching.vllm.sync.mode=adapter",
        "model.adapter={r: 4}",
        "custom.extra.rollout_matching.vllm.sync.transport=disk",
    )
    assert (
        "adapter syncs run over transport: http only" in probs["custom.extra.rollout_matching.vllm.sync.mode"]
    )
    probs = problems_of(
        tmp_path,
        ASYNC,
        "custom.extra.rollout_matching.vllm.sync.mode=adapter",
        "model.adapter={r: 4}",
        "custom.extra.rollout_matching.vllm.sync.delta=true",
    )
    assert "without delta" in probs["custom.extra.rollout_matching.vllm.sync.mode"]
    overrides = ["custom.extra.rollout_matching.vllm.sync.mode=adapter", "model.adapter={r: 4}"]
    cfg = load_config(write(tmp_path, ASYNC), overrides, world_size=2)
    assert cfg.model.adapter is not None and cfg.model.adapter.r == 4


def test_colocate_gets_a_migration_message(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, ASYNC, "custom.extra.rollout_matching.vllm.mode=colocate")
    message = probs["custom.extra.rollout_matching.vllm.mode"]
    assert "never supported" in message and "use rollout_backend: hf" in message


def test_async_valid(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, ASYNC), world_size=2)
    assert cfg.stage2_ab is not None and cfg.stage2_ab.channel_b.async_.queue_limit == 8


SYNC = "custom.extra.rollout_matching.vllm.sync"


def test_delta_sync_needs_http(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, ASYNC, f"{SYNC}.transport=disk", f"{SYNC}.delta=true")
    assert (
        probs[f"{SYNC}.delta"]
        == "delta belongs to transport: http, not transport: disk; set that, or remove it"
    )
    cfg = load_config(write(tmp_path, ASYNC), [f"{SYNC}.delta=true"], world_size=2)
    assert cfg.custom.extra.rollout_matching.vllm.sync.delta


def test_unknown_sync_transport_names_the_key(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, ASYNC, f"{SYNC}.transport=ipc")
    assert f"{SYNC}.transport" in probs and "disk" in probs[f"{SYNC}.transport"]


def test_nccl_transport_gets_a_migration_message(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, ASYNC, f"{SYNC}.transport=nccl")
    message = probs[f"{SYNC}.transport"]
    assert "nccl was never implemented" in message and "use transport: collective" in message


def test_shm_transport_gets_a_migration_message(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, ASYNC, f"{SYNC}.transport=shm")
    message = probs[f"{SYNC}.transport"]
    assert "shm was removed" in message and "use transport: disk with disk_dir on a tmpfs" in message


@pytest.mark.parametrize(
    ("transport", "key", "owner"),
    [
        ("http", "group_address=10.0.0.2", "transport: collective"),
        ("http", "disk_dir=/tmp/w", "transport: disk"),
        ("disk", "chunk_mb=8", "transport: http"),
        ("collective", "delta=true", "transport: http"),
        ("disk", "group_address=10.0.0.2", "transport: collective"),
    ],
)
def test_a_key_of_another_transport_names_its_transport(
    tmp_path: Path, transport: str, key: str, owner: str
) -> None:
    """The sync config is one section per transport: a key of another is refused at its own path."""
    probs = problems_of(tmp_path, ASYNC, f"{SYNC}.transport={transport}", f"{SYNC}.{key}")
    name = key.split("=")[0]
    assert (
        probs[f"{SYNC}.{name}"]
        == f"{name} belongs to {owner}, not transport: {transport}; set that, or remove it"
    )


def test_a_sync_section_without_transport_is_http_and_errors_name_the_real_key(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, ASYNC, f"{SYNC}={{chunk_mb: 0}}")
    assert "greater than 0" in probs[f"{SYNC}.chunk_mb"]  # no `http` tag inside the path
    cfg = load_config(write(tmp_path, ASYNC), [f"{SYNC}={{chunk_mb: 8}}"], world_size=2)
    sync = cfg.custom.extra.rollout_matching.vllm.sync
    assert sync.transport == "http" and sync.chunk_mb == 8


def test_collective_sync_needs_a_reachable_group_address_for_remote_servers(tmp_path: Path) -> None:
    servers = "custom.extra.rollout_matching.vllm.server.servers=[{base_url: 'http://10.0.0.7:8000'}]"
    probs = problems_of(tmp_path, ASYNC, f"{SYNC}.transport=collective", servers)
    assert "cannot reach the weight group at 127.0.0.1" in probs[f"{SYNC}.group_address"]
    reachable = f"{SYNC}.group_address=10.0.0.2"
    cfg = load_config(
        write(tmp_path, ASYNC), [f"{SYNC}.transport=collective", servers, reachable], world_size=2
    )
    assert cfg.custom.extra.rollout_matching.vllm.sync.transport == "collective"


def test_pipeline_requires_server_rollouts(tmp_path: Path) -> None:
    data = {**BASE, "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"enable_pipeline": True}}}
    probs = problems_of(tmp_path, data)
    assert "vllm.mode: server" in probs["stage2_ab.channel_b.enable_pipeline"]


def test_rollout_buffer_removed(tmp_path: Path) -> None:
    data = {**BASE, "custom": {"extra": {"rollout_matching": {"rollout_buffer": {"size": 4}}}}}
    probs = problems_of(tmp_path, data)
    assert "async" in probs["custom.extra.rollout_matching.rollout_buffer"]


def test_queue_limit_below_gas(tmp_path: Path) -> None:
    probs = problems_of(
        tmp_path,
        ASYNC,
        "training.gradient_accumulation_steps=4",
        "stage2_ab.channel_b.async.queue_limit=2",
        "stage2_ab.channel_b.async.prefetch_target_packs=2",
    )
    assert "queue_limit >= 4" in probs["stage2_ab.channel_b.async.queue_limit"]


def test_prefetch_target_above_queue_limit(tmp_path: Path) -> None:
    probs = problems_of(
        tmp_path,
        ASYNC,
        "stage2_ab.channel_b.async.queue_limit=4",
        "stage2_ab.channel_b.async.prefetch_target_packs=6",
    )
    assert "prefetch_target_packs <= queue_limit" in probs["stage2_ab.channel_b.async.prefetch_target_packs"]


def test_unknown_keys_have_dotted_paths_and_suggestions(tmp_path: Path) -> None:
    data = {**BASE, "training": {"lerning_rate": 1e-4}, "bogus_section": {}}
    probs = problems_of(tmp_path, data)
    assert "did you mean 'training.learning_rate'" in probs["training.lerning_rate"]
    assert "unknown key" in probs["bogus_section"]


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("learning_rate", "(did you mean 'training.learning_rate'?)"),  # a section's key at the top
        (
            "training.max_new_tokens",
            "'reflection.max_new_tokens' or 'custom.extra.rollout_matching.max_new_tokens'",
        ),
        ("training.global_max_lenght", "(did you mean 'global_max_length'?)"),  # misspelt, in another section
        ("training.max_step", "(did you mean 'training.max_steps'?)"),  # misspelt, in its own section
        (  # a key of the section's list entries; it suggested Stage-B's 'runner.server.base_urls'
            "custom.extra.rollout_matching.vllm.server.base_url",
            "(did you mean 'custom.extra.rollout_matching.vllm.server.servers', a list of {base_url: ...} entries?)",
        ),
    ],
)
def test_an_unknown_key_is_suggested_where_it_belongs(tmp_path: Path, key: str, suggestion: str) -> None:
    probs = problems_of(tmp_path, BASE, f"{key}=1")
    assert probs[key].startswith("unknown key; remove it") and suggestion in probs[key]


def test_every_problem_reported_at_once(tmp_path: Path) -> None:
    data = {
        **ASYNC,
        "training": {"lerning_rate": 1, "max_steps": 0, "gradient_accumulation_steps": 4},
        "model": {"torch_dtype": "fp8"},
    }
    probs = problems_of(tmp_path, data, "stage2_ab.channel_b.async.queue_limit=2")
    assert {
        "training.lerning_rate",
        "training.max_steps",
        "model.torch_dtype",
        "stage2_ab.channel_b.async.queue_limit",
    } <= set(probs)


def test_overrides_apply_and_parse_yaml_values(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, BASE),
        ["training.learning_rate=1e-5", "training.packing=false", "stage2_ab.channel_b.rollouts_per_step=3"],
    )
    assert cfg.training.learning_rate == 1e-5
    assert cfg.training.packing is False
    assert cfg.stage2_ab is not None and cfg.stage2_ab.channel_b.rollouts_per_step == 3


def test_override_errors_are_reported(tmp_path: Path) -> None:
    probs = problems_of(
        tmp_path, {**BASE, "training": {"max_steps": 5}}, "training.learning_rate", "training.max_steps.x=3"
    )
    assert "key.path=value" in probs["training.learning_rate"]
    assert "not a section" in probs["training.max_steps.x"]


def test_apply_override_creates_sections() -> None:
    raw: dict = {}
    apply_override(raw, "a.b.c=[1, 2]")
    assert raw == {"a": {"b": {"c": [1, 2]}}}


def test_effective_batch_size_derives_gas(tmp_path: Path) -> None:
    data = {
        **BASE,
        "training": {"packing": False, "per_device_train_batch_size": 2, "effective_batch_size": 8},
    }
    cfg = load_config(write(tmp_path, data))
    resolved = resolve_config(cfg, 1)
    assert resolved.gradient_accumulation_steps == 4
    assert resolved.rollouts_per_step == 8
    packed = {**BASE, "training": {"effective_batch_size": 8}}  # packing: 8 packed sequences per step
    assert resolve_config(load_config(write(tmp_path, packed)), 2).gradient_accumulation_steps == 4


def test_packing_counts_packed_sequences_so_the_micro_batch_is_one(tmp_path: Path) -> None:
    problems = problems_of(tmp_path, {**BASE, "training": {"per_device_train_batch_size": 4}})
    message = problems["training.per_device_train_batch_size"]
    assert "one packed sequence" in message and "gradient_accumulation_steps" in message
    assert "packing: false" in message
    load_config(write(tmp_path, {**BASE, "training": {"packing": False, "per_device_train_batch_size": 4}}))


def test_effective_batch_size_inconsistent(tmp_path: Path) -> None:
    data = {
        **BASE,
        "training": {
            "per_device_train_batch_size": 2,
            "effective_batch_size": 8,
            "gradient_accumulation_steps": 3,
        },
    }
    assert "training.effective_batch_size" in problems_of(tmp_path, data)


def test_server_beyond_loopback_needs_token(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, {"rollout_server": {"host": "0.0.0.0"}})
    assert "bearer token" in probs["rollout_server.auth_token_env"]


def test_server_rollouts_need_a_server(tmp_path: Path) -> None:
    data = {**BASE, "custom": {"extra": {"rollout_matching": {"rollout_backend": "vllm"}}}}
    assert (
        "embedded: true" in problems_of(tmp_path, data)["custom.extra.rollout_matching.vllm.server.servers"]
    )


def test_an_a_only_run_of_a_server_config_needs_no_server(tmp_path: Path) -> None:
    """`b_ratio: 0` (the A-only baseline of an AB config) never calls a rollout server: an empty server list
    is accepted, and the same config with B steps still needs one."""
    data = {**ASYNC, "stage2_ab": {"schedule": {"b_ratio": "0"}, "channel_b": {"mode": "async"}}}
    key = "custom.extra.rollout_matching.vllm.server.servers"
    load_config(write(tmp_path, data), [f"{key}=[]"])
    assert (
        "at least one server"
        in problems_of(tmp_path, data, f"{key}=[]", "stage2_ab.schedule.b_ratio=0.25")[key]
    )


def test_yaml_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  max_steps: [1,\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_config(path)


def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    """A second `training:` block appended to a file replaced the first one whole: its learning_rate,
    output_dir, ... fell back to their defaults without a word."""
    path = tmp_path / "twice.yaml"
    head = yaml.safe_dump(BASE)
    path.write_text(
        head + "training:\n  learning_rate: 0.002\n  max_steps: 24\n" + "training:\n  max_steps: 99\n"
    )
    first = head.count("\n") + 1
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (
        f"<yaml>: not valid YAML at line {first + 3}, column 1: key 'training' is written twice in one mapping "
        f"(first at line {first}); YAML would keep only the last"
    ) in str(info.value)


def test_a_merge_key_may_be_overridden(tmp_path: Path) -> None:
    """`<<: {...}` (or `<<: *anchor`) then an explicit key is YAML's way to override a shared block: not a key
    written twice."""
    path = tmp_path / "merge.yaml"
    path.write_text(
        yaml.safe_dump(BASE)
        + "training:\n  <<: {max_steps: 5, seed: 3, learning_rate: 0.001}\n  max_steps: 7\n"
    )
    cfg = load_config(path)
    assert (cfg.training.max_steps, cfg.training.seed, cfg.training.learning_rate) == (7, 3, 0.001)


def test_an_anchored_mapping_with_a_merge_and_an_override_may_be_merged_again(tmp_path: Path) -> None:
    """PyYAML flattens an anchored mapping in place when a merge naming it is built first: the merged
    `temperature` and its override then read as one key written twice (a valid config was refused)."""
    text = (
        "custom:\n"
        "  extra:\n"
        "    rollout_matching:\n"
        "      decoding: &dec\n"
        "        <<: {temperature: 0.01, top_p: 0.95, top_k: 0}\n"
        "        temperature: 0.2\n"
        "data:\n"
        "  synthetic: {num_samples: 8}\n"
        "  eval:\n"
        "    decoding:\n"
        "      <<: *dec\n"
        "stage2_ab:\n"
        "  schedule: {b_ratio: 0.25}\n"
    )
    path = tmp_path / "anchors.yaml"
    path.write_text(text)
    assert yaml.safe_load(text)["data"]["eval"]["decoding"]["temperature"] == 0.2
    cfg = load_config(path)
    assert cfg.data.eval is not None and cfg.data.eval.decoding.temperature == 0.2


def test_the_config_reader_builds_no_python_object(tmp_path: Path) -> None:
    """The duplicate-key reader is a SafeLoader: a `!!python/object` tag is a YAML error, never a call."""
    path = tmp_path / "object.yaml"
    path.write_text(yaml.safe_dump(BASE) + "extra: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line .*could not determine a constructor"):
        load_config(path)


def test_top_level_not_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(path)


def test_data_needs_exactly_one_source(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, {**BASE, "data": {}})
    assert any("exactly one of data.train_jsonl or data.synthetic" in m for m in probs.values())


def test_synthetic_side_fraction(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE), ["data.synthetic.side_fraction=[0.3, 0.5]"])
    assert cfg.data is not None and cfg.data.synthetic is not None
    assert cfg.data.synthetic.generator_kwargs()["side_fraction"] == (0.3, 0.5)
    reversed_range = problems_of(tmp_path, BASE, "data.synthetic.side_fraction=[0.5, 0.3]")
    assert any("low must not exceed high" in m for m in reversed_range.values())
    too_big = problems_of(tmp_path, BASE, "data.synthetic.side_fraction=[0.3, 0.95]")
    assert any(path.startswith("data.synthetic.side_fraction") for path in too_big)


def test_stage_b_required_keys(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, {"mission": "m"})
    assert {"tickets", "guidance.path"} <= set(probs)


def test_stage_b_runner_rules(tmp_path: Path) -> None:
    base = {"mission": "m", "tickets": ["t.jsonl"], "guidance": {"path": "g.json"}}
    probs = problems_of(tmp_path, {**base, "runner": {"engine": "server"}, "launch": {"nnodes": 2}})
    assert "rollout server URL" in probs["runner.server.base_urls"]
    assert "--nnodes=1" in probs["launch.nnodes"]
    probs = problems_of(tmp_path, {**base, "runner": {"engine": "test", "test_engine": {"fail_on_rank": 1}}})
    assert "renamed to `rules`" in probs["runner.engine"]
    assert "runner.engine: rules" in probs["runner.test_engine"]
    assert load_config(write(tmp_path, {**base, "runner": {"engine": "rules"}})).runner.engine == "rules"


@pytest.mark.parametrize("mission", ["挡风板安装检查", "shapes_qc", "BBU-安装.v2"])
def test_a_mission_may_be_named_in_any_script(tmp_path: Path, mission: str) -> None:
    """Upstream's missions are the names of its data directories (`挡风板安装检查`): they were refused at
    run time ("must be a plain name (letters, digits, _ . -)") after validate-config had passed them."""
    base = {"mission": mission, "tickets": ["t.jsonl"], "guidance": {"path": "g.json"}}
    assert load_config(write(tmp_path, base)).mission == mission


@pytest.mark.parametrize("mission", ["a b", "../x", "a/b", ".hidden", "_x", "x\n"])
def test_a_mission_that_is_no_plain_directory_name_is_refused_by_the_config(
    tmp_path: Path, mission: str
) -> None:
    base = {"mission": mission, "tickets": ["t.jsonl"], "guidance": {"path": "g.json"}}
    message = problems_of(tmp_path, base)["mission"]
    assert message.startswith(f"{mission!r} is not a plain name: it becomes the run's directory")


# ---------------------------------------------------------------- precision and sharding (#23)

A_ONLY = {**BASE, "stage2_ab": {"schedule": {"b_ratio": 0.0}}}


def test_bf16_storage_without_mixed_precision_is_refused_naming_the_key(tmp_path: Path) -> None:
    probs = problems_of(tmp_path, {**BASE, "model": {"torch_dtype": "bfloat16"}})
    message = probs["training.mixed_precision"]
    assert "training.mixed_precision: bf16" in message and "allow_low_precision_params: true" in message


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["training.allow_low_precision_params=true"], "training.allow_low_precision_params"),
        (
            [
                "model.torch_dtype=bfloat16",
                "training.allow_low_precision_params=true",
                "training.mixed_precision=bf16",
            ],
            "training.allow_low_precision_params",
        ),
    ],
)
def test_a_meaningless_low_precision_opt_in_is_refused(
    tmp_path: Path, overrides: list[str], key: str
) -> None:
    assert key in problems_of(tmp_path, BASE, *overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.torch_dtype=bfloat16", "training.mixed_precision=bf16"],
        ["training.mixed_precision=bf16"],  # float32 storage, bf16 compute
        ["model.torch_dtype=bfloat16", "training.allow_low_precision_params=true"],  # explicit opt-in
    ],
)
def test_accepted_precision_combinations(tmp_path: Path, overrides: list[str]) -> None:
    load_config(write(tmp_path, BASE), overrides)


def test_fsdp_needs_two_ranks_bf16_and_server_rollouts(tmp_path: Path) -> None:
    probs = problems_of(
        tmp_path, BASE, "training.parallelism=fsdp", "training.mixed_precision=fp16", world_size=1
    )
    assert "run with --nproc 2" in probs["training.parallelism"]
    assert "use bf16 under fsdp" in probs["training.mixed_precision"]
    assert "rollout server" in probs["custom.extra.rollout_matching.rollout_backend"]


def test_a_section_its_own_rule_refused_adds_no_problem_about_its_defaults(tmp_path: Path) -> None:
    """`training`'s own rule fails (fused CE under fsdp): the section is dropped, so the cross-section rules
    read its defaults (`mixed_precision: no`) next to `model.torch_dtype: bfloat16`; the problem that makes
    about `training.mixed_precision`, which the user did set to bf16, is not reported."""
    probs = problems_of(
        tmp_path,
        {**ASYNC, "model": {"torch_dtype": "bfloat16"}},
        "training.parallelism=fsdp",
        "training.mixed_precision=bf16",
        "training.kernels.fused_linear_cross_entropy=true",
        world_size=2,
    )
    assert list(probs) == ["training"] and "fused_linear_cross_entropy" in probs["training"]


def test_fsdp_accepts_a_only_and_async_server_runs(tmp_path: Path) -> None:
    load_config(write(tmp_path, A_ONLY), ["training.parallelism=fsdp"], world_size=2)
    load_config(write(tmp_path, ASYNC, "async.yaml"), ["training.parallelism=fsdp"], world_size=2)


@pytest.mark.parametrize("top_k", [-1, 0])
def test_upstream_top_k_minus_one_means_off(tmp_path: Path, top_k: int) -> None:
    # an upstream rollout config: `top_k: -1` is "off", as vLLM writes it
    data = {**BASE, "custom": {"extra": {"rollout_matching": {"decoding": {"top_k": top_k, "top_p": 1.0}}}}}
    cfg = load_config(write(tmp_path, data))
    assert cfg.custom.extra.rollout_matching.decoding.top_k == 0


def test_top_k_below_minus_one_is_refused(tmp_path: Path) -> None:
    data = {**BASE, "custom": {"extra": {"rollout_matching": {"decoding": {"top_k": -2}}}}}
    problems = problems_of(tmp_path, data)
    assert "custom.extra.rollout_matching.decoding.top_k" in problems


@pytest.mark.parametrize("attention", ["eager", "flash_attention_2"])
def test_varlen_packed_attention_with_another_attention_is_refused_before_the_model_loads(
    tmp_path: Path, attention: str
) -> None:
    probs = problems_of(
        tmp_path, BASE, "training.kernels.packed_attention=varlen", f"model.attn_implementation={attention}"
    )
    assert f"model.attn_implementation is {attention}" in probs["training.kernels.packed_attention"]
    load_config(write(tmp_path, BASE, "sdpa.yaml"), ["training.kernels.packed_attention=varlen"])


def test_tls_options_for_plain_http_servers_are_refused_also_for_an_embedded_one(tmp_path: Path) -> None:
    """The embedded server (no `rollout_server.tls_certfile`) is http:// at 127.0.0.1: a `tls_skip_verify`
    for it verifies nothing and was accepted; listed http:// servers were already refused."""
    key = "custom.extra.rollout_matching.vllm.server.tls_skip_verify"
    embedded = {**ASYNC, "rollout_server": {"embedded": True}}
    embedded["custom"] = {
        "extra": {"rollout_matching": {"rollout_backend": "vllm", "vllm": {"mode": "server"}}}
    }
    assert "applies to https:// servers only" in problems_of(tmp_path, embedded, f"{key}=true")[key]
    assert "applies to https:// servers only" in problems_of(tmp_path, ASYNC, f"{key}=true")[key]


def test_an_invalid_adapter_is_one_problem_not_also_a_missing_one(tmp_path: Path) -> None:
    """`model.adapter.target_modules=[q_projj]` dropped the adapter, and the adapter-sync rule then said it
    "is not set": a second, false problem about a value the user did write."""
    example = Path(__file__).resolve().parents[3] / "examples" / "tiny" / "train_ab_lora.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(example, ["model.adapter.target_modules=[q_projj]"], world_size=1)
    assert [p.path for p in info.value.problems] == ["model.adapter"]
    with pytest.raises(ConfigError) as info:
        load_config(example, ["model.adapter=null"], world_size=1)
    assert [p.path for p in info.value.problems] == ["custom.extra.rollout_matching.vllm.sync.mode"]


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("bf16", "here: training.mixed_precision: bf16"),
        ("fp16", "here: training.mixed_precision: fp16"),
        ("num_train_epochs", "here: training.max_steps"),
        ("warmup_ratio", "here: training.warmup_steps"),
    ],
)
def test_a_hugging_face_trainer_key_names_stagectls(tmp_path: Path, key: str, hint: str) -> None:
    """They got the list of valid keys, which does not say that `bf16: true` is `mixed_precision: bf16`."""
    problems = problems_of(tmp_path, BASE, f"training.{key}=1")
    assert hint in problems[f"training.{key}"]


@pytest.mark.parametrize(("value", "expected"), [("tensorboard", ["tensorboard"]), ("none", [])])
def test_report_to_as_the_hugging_face_trainer_spells_it(
    tmp_path: Path, value: str, expected: list[str]
) -> None:
    """`report_to: tensorboard` (one name) was `Input should be a valid list`."""
    assert load_config(write(tmp_path, BASE), [f"training.report_to={value}"]).training.report_to == expected


def test_every_path_key_reads_a_leading_tilde_as_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only training.output_dir and resume_from_checkpoint expanded `~`: `data.train_jsonl=~/demo/train.jsonl`
    was `no such file` although the file was there (a `--set` value is not expanded by the shell)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    data = {**BASE, "data": {"train_jsonl": "~/demo/train.jsonl", "image_root": "~/imgs"}}
    cfg = load_config(
        write(tmp_path, data), ["rollout_server.image_roots=[~/a]", "training.output_dir=~/run"]
    )
    assert (cfg.data.train_jsonl, cfg.data.image_root) == (tmp_path / "demo/train.jsonl", tmp_path / "imgs")
    assert (cfg.rollout_server.image_roots, cfg.training.output_dir) == ([tmp_path / "a"], tmp_path / "run")
