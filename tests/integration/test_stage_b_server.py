"""`runner.engine: server`: Stage-B rollouts through the real rollout server app on 127.0.0.1.

The server runs a judge-shaped fake of the rollout `Engine` protocol (answers `Verdict/Reason` from the
prompt text, echoing the seed it was given), so the whole path — prompt messages, request config,
per-request seeds, reflection through the server — is exercised without a model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch

from stagectl.config import load_config
from stagectl.config.plan_stage_b import stage_b_plan
from stagectl.engines.interface import EngineRequest, EngineResult, TensorSpec
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.stage_b.runner import run_all


class JudgeEcho:
    """Fails a group when its summaries mention `red`; answers reflection prompts with no operation."""

    name = "fake"
    model_name = "judge-echo"
    version = 0
    max_model_len = 4096
    max_batch_size = None

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def generate(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        return [self._one(r) for r in requests]

    def _one(self, request: EngineRequest) -> EngineResult:
        system, user = (str(m["content"]) for m in request.messages)
        self.prompts.append(user)
        if "maintain the guidance" in system:
            text = '{"operations": []}'
        else:
            summaries = user.split("Image summaries:", 1)[1]
            verdict = "fail" if "red" in summaries else "pass"
            text = f"Verdict: {verdict}\nReason: seed={request.seed}"
        return EngineResult([], list(text.encode()), text, "stop", 0)

    def weight_specs(self) -> dict[str, TensorSpec]:
        return {}

    def apply_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError

    def batch_sizes(self) -> dict[int, int]:
        return {}

    def close(self) -> None:
        pass


TOKEN = "stage-b-token"


@pytest.fixture
def served() -> Iterator[tuple[str, JudgeEcho]]:
    engine = JudgeEcho()
    settings = ServerSettings(auth_token=TOKEN)  # Stage-B's client must send it on /infer/ too
    server = ThreadedServer(build_app(RolloutService(engine, settings))).start()  # type: ignore[arg-type]
    yield server.url, engine
    server.stop()


def test_stage_b_through_the_rollout_server(
    served: tuple[str, JudgeEcho], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STAGECTL_TEST_STAGE_B_TOKEN", TOKEN)
    url, engine = served
    tickets = tmp_path / "t.jsonl"
    rows = [
        {
            "mission": "m",
            "group_id": f"g{k}",
            "label": "fail" if k % 2 else "pass",
            "per_image": {"image_1": s},
        }
        for k, s in enumerate(["blue dot", "red dot", "green dot", "blue square", "red box", "grey dot"])
    ]
    tickets.write_text("".join(json.dumps(r) + "\n" for r in rows))
    guidance = tmp_path / "g.json"
    guidance.write_text(json.dumps({"step": 0, "updated_at": "", "experiences": {"G0": "f", "G1": "r"}}))
    cfg = load_config(
        None,
        [
            "mission=m",
            f"tickets=[{tickets}]",
            f"guidance.path={guidance}",
            f"output.root={tmp_path / 'out'}",
            "runner.engine=server",
            f"runner.server.base_urls=[{url}]",
            "runner.server.auth_token_env=STAGECTL_TEST_STAGE_B_TOKEN",
            "runner.per_rank_rollout_batch_size=3",
            "sampler.grid=[{seed: 0}, {seed: 1, temperature: 0}]",
            "reflection.batch_size=2",
        ],
    )
    summary = run_all(stage_b_plan(cfg))
    assert summary is not None and summary.num_judged == 6 and summary.num_reflections == 1
    run_dir = tmp_path / "out" / "default" / "m"
    selections = [json.loads(line) for line in (run_dir / "selections.jsonl").read_text().splitlines()]
    verdicts = {r["group_id"]: r["verdict"] for r in selections}
    assert verdicts == {"g0": "pass", "g1": "fail", "g2": "pass", "g3": "pass", "g4": "fail", "g5": "pass"}
    # Request i of one infer call is sampled with the decode seed + i (the server protocol).
    trajectories = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    for batch in (0, 1):
        rows_of = [r for r in trajectories if r["batch_index"] == batch and r["grid_index"] == 0]
        got = [int(re.sub(r".*seed=", "", r["reason"])) for r in rows_of]
        assert got == [rows_of[0]["seed"] + i for i in range(3)]
    reflection = json.loads((run_dir / "reflection.jsonl").read_text())
    assert reflection["decode_error"] is None and reflection["changed"] is False
    assert len(engine.prompts) == 6 * 2 + 1
    rollout_prompts = [p for p in engine.prompts if "Image summaries:" in p]
    assert len(rollout_prompts) == 12
    assert not any("pass" in p or "fail" in p or "::" in p for p in rollout_prompts)  # never the label


def test_unreachable_server_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tickets = tmp_path / "t.jsonl"
    tickets.write_text(
        json.dumps({"mission": "m", "group_id": "g", "label": "pass", "per_image": {"image_1": "a"}})
    )
    guidance = tmp_path / "g.json"
    guidance.write_text(json.dumps({"step": 0, "updated_at": "", "experiences": {"G0": "f"}}))
    base = ["mission=m", f"tickets=[{tickets}]", f"guidance.path={guidance}", f"output.root={tmp_path}"]
    with pytest.raises(ValueError, match=r"runner\.server\.base_urls: runner\.engine: server needs"):
        load_config(None, [*base, "runner.engine=server"])  # the validator refuses it
    cfg = load_config(
        None,
        [
            *base,
            "runner.engine=server",
            "runner.server.base_urls=[http://127.0.0.1:9]",
            "runner.server.wait_healthy_s=0.5",
        ],
    )
    with pytest.raises(ValueError, match="not healthy"):
        run_all(stage_b_plan(cfg))
