"""The rollout server's plan: the `/infer/` bounds resolved from the config that will call the server (a
train-ab learner, a Stage-B runner, explicit keys), the weight-sync routes it mounts, the model it loads;
and the learner's servers as the doctor probes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagectl.config import load_config
from stagectl.config.plan_server import learner_servers, server_plan
from stagectl.config.rollout import DEFAULT_MAX_NEW_TOKENS_CAP, DEFAULT_MAX_REQUESTS_PER_CALL

TRAIN_AB = ["data.synthetic.num_samples=8", "stage2_ab.schedule.b_ratio=0.5"]
SERVER_ROLLOUTS = [
    *TRAIN_AB,
    "custom.extra.rollout_matching.rollout_backend=vllm",
    "rollout_server.embedded=true",
]
STAGE_B = ["mission=m", "tickets=[t.jsonl]", "guidance.path=g.json"]


def _limits(*overrides: str) -> tuple[int, int]:
    plan = server_plan(load_config(None, list(overrides)))
    return plan.max_new_tokens_cap, plan.max_requests_per_call


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], (DEFAULT_MAX_NEW_TOKENS_CAP, DEFAULT_MAX_REQUESTS_PER_CALL)),  # a plain serving config
        # train-ab: its learner's rollout length and decode chunk (the embedded server's caller)
        (
            [
                *SERVER_ROLLOUTS,
                "custom.extra.rollout_matching.max_new_tokens=10000",
                "stage2_ab.channel_b.rollout_decode_batch_size=2048",
            ],
            (10000, 2048),
        ),
        (  # the chunk defaults to rollout_matching.decode_batch_size
            [*TRAIN_AB, "custom.extra.rollout_matching.decode_batch_size=1500"],
            (DEFAULT_MAX_NEW_TOKENS_CAP, 1500),
        ),
        # Stage-B: the longest sampler or reflection answer, the per-rank batch
        (
            [*STAGE_B, "sampler.grid=[{max_new_tokens: 9000}]", "runner.per_rank_rollout_batch_size=1500"],
            (9000, 1500),
        ),
        ([*STAGE_B, "reflection.max_new_tokens=9500"], (9500, DEFAULT_MAX_REQUESTS_PER_CALL)),
        # explicit keys win (a validator refuses ones below what the config's own caller asks for)
        (["rollout_server.max_new_tokens_cap=512", "rollout_server.max_requests_per_call=16"], (512, 16)),
        ([*TRAIN_AB, "rollout_server.max_new_tokens_cap=4096"], (4096, DEFAULT_MAX_REQUESTS_PER_CALL)),
    ],
)
def test_call_limits_are_what_the_calling_config_asks_for(
    overrides: list[str], expected: tuple[int, int]
) -> None:
    assert _limits(*overrides) == expected


def test_an_embedded_server_takes_its_learners_transport_only(tmp_path: Path) -> None:
    yaml = "custom:\n  extra:\n    rollout_matching:\n      rollout_backend: vllm\n"
    (tmp_path / "c.yaml").write_text(yaml)
    sync = "custom.extra.rollout_matching.vllm.sync.transport=disk"
    embedded = load_config(tmp_path / "c.yaml", [sync, "rollout_server.embedded=true"])
    standalone = load_config(tmp_path / "c.yaml", [sync])
    assert server_plan(embedded).weight_transports == {"disk"}
    assert server_plan(standalone).weight_transports == {"http", "collective", "disk"}


def test_the_served_model() -> None:
    plain = server_plan(load_config(None, ["model.torch_dtype=bfloat16", "model.attn_implementation=eager"]))
    assert plain.model.coord_tokens is False  # the checkpoint as it is
    assert (plain.model.torch_dtype, plain.model.attn_implementation) == ("bfloat16", "eager")
    assert plain.model.adapter is None and not plain.model.adapter_sync
    assert server_plan(load_config(None, TRAIN_AB)).model.coord_tokens is True  # as the learner loads it
    adapter = ["model.adapter={type: lora, r: 4, alpha: 8}"]
    full = server_plan(load_config(None, adapter))
    assert full.model.adapter is None  # full syncs: the merged weights arrive
    synced = server_plan(
        load_config(None, [*adapter, "custom.extra.rollout_matching.vllm.sync.mode=adapter"])
    )
    assert synced.model.adapter_sync and synced.model.adapter is not None and synced.model.adapter.r == 4


def test_learner_servers_as_the_doctor_probes_them() -> None:
    in_learner = learner_servers(load_config(None, TRAIN_AB))
    assert in_learner.rollouts is None and in_learner.rollout_engine is None
    servers = [
        *TRAIN_AB,
        "custom.extra.rollout_matching.rollout_backend=vllm",
        "custom.extra.rollout_matching.vllm.server.servers=[{base_url: 'http://127.0.0.1:9'}]",
        "model.torch_dtype=bfloat16",
    ]
    plain = learner_servers(load_config(None, [*servers, "training.mixed_precision=bf16"]))
    assert plain.rollouts is not None and plain.rollout_engine == "hf" and not plain.embedded
    assert (plain.sync_dtype, plain.adapter_sync) == ("bfloat16", False)
    adapter = [
        *servers,
        "model.adapter={type: lora, r: 4, alpha: 8}",
        "custom.extra.rollout_matching.vllm.sync.mode=adapter",
    ]
    merged = learner_servers(load_config(None, [*adapter, "training.mixed_precision=bf16"]))
    assert (merged.sync_dtype, merged.adapter_sync) == ("float32", True)  # peft's tensors, merged by hf
