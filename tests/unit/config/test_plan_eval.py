"""`stagectl eval`'s plan: the held-out eval part (the same `EvalPlan` train-ab's periodic eval gets), the
model, and for `--server` a `ServerList` with the token, TLS and timeouts of `rollout_matching.vllm.server`."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagectl.config import load_config
from stagectl.config.plan import SERVERS_KEY, ServerList
from stagectl.config.plan_eval import eval_session
from stagectl.config.plan_train import train_plan
from stagectl.config.sampling import SamplingSpec

CONFIG = Path(__file__).parents[3] / "examples" / "tiny" / "learn_shapes.yaml"
EVAL = [
    "data.eval.score=objectness",
    "data.eval.gallery_images=3",
    "data.eval.decoding.temperature=0.5",
    "data.eval.decoding.top_p=0.8",
    "custom.extra.rollout_matching.max_new_tokens=77",
    "custom.extra.rollout_matching.repetition_penalty=1.1",
    "custom.extra.rollout_matching.decode_batch_size=5",
    "stage2_ab.channel_b.duplicate_iou_threshold=0.6",
]


def test_the_eval_part_of_a_config() -> None:
    cfg = load_config(CONFIG, EVAL)
    session = eval_session(cfg)
    plan = session.eval
    assert cfg.data is not None and plan.data == cfg.data.eval and plan.box_format == cfg.data.box_format
    assert plan.sampling == SamplingSpec(
        max_new_tokens=77, temperature=0.5, top_p=0.8, repetition_penalty=1.1, logprobs=True
    )
    assert plan.chunk_size == 5 and plan.duplicate_iou_threshold == 0.6
    assert plan.score == "objectness" and plan.data.gallery_images == 3
    assert session.model == cfg.model and session.server is None  # in process


def test_the_learner_and_stagectl_eval_evaluate_alike() -> None:
    cfg = load_config(CONFIG, EVAL)
    assert train_plan(cfg, world_size=1).eval == eval_session(cfg).eval


def test_server_is_a_server_list_with_the_rollout_servers_token_tls_and_timeouts() -> None:
    cfg = load_config(
        CONFIG,
        [
            "custom.extra.rollout_matching.vllm.server.auth_token_env=EVAL_TOKEN",
            "custom.extra.rollout_matching.vllm.server.infer_timeout_s=45",
            "custom.extra.rollout_matching.vllm.server.timeout_s=9",
            "custom.extra.rollout_matching.vllm.server.tls_skip_verify=true",
        ],
    )
    servers = eval_session(cfg, "https://10.0.0.3:8000/").server
    assert servers is not None
    assert servers == ServerList(
        base_urls=("https://10.0.0.3:8000/",),  # as given: metrics.json names it so
        key=SERVERS_KEY,
        auth_token_env="EVAL_TOKEN",
        tls_skip_verify=True,
        infer_timeout_s=45.0,
        wait_healthy_s=9.0,
    )
    assert servers.token_key == "custom.extra.rollout_matching.vllm.server.auth_token_env"


def test_a_config_without_data_eval_has_nothing_to_evaluate() -> None:
    cfg = load_config(None, [])
    with pytest.raises(ValueError, match=r"nothing to evaluate \(no data.eval\): set data.eval"):
        eval_session(cfg)


def test_a_missing_server_token_names_the_rollout_matching_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from stagectl.inference.client import RolloutClient

    monkeypatch.delenv("STAGECTL_TEST_NO_SUCH_TOKEN", raising=False)
    cfg = load_config(
        CONFIG, ["custom.extra.rollout_matching.vllm.server.auth_token_env=STAGECTL_TEST_NO_SUCH_TOKEN"]
    )
    servers = eval_session(cfg, "http://127.0.0.1:9").server
    assert servers is not None
    with pytest.raises(
        ValueError,
        match=r"^custom\.extra\.rollout_matching\.vllm\.server\.auth_token_env names \$STAGECTL_TEST_NO_SUCH_TOKEN",
    ):
        RolloutClient.for_servers(servers)
