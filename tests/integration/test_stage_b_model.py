"""The model backend (the hf engine) with the tiny model, in process: judge and reflect answer text, seeded reproducibly."""

from __future__ import annotations

from stagectl.config import load_config
from stagectl.config.plan_stage_b import ModelBackendPlan, backend_plan
from stagectl.config.sampling import SamplingSpec
from stagectl.dist import World
from stagectl.stage_b.engine import JudgeRequest, ReflectRequest
from stagectl.stage_b.engine_model import load_model_backend
from stagectl.stage_b.guidance import Guidance
from stagectl.stage_b.prompts import ReflectionRecord, reflection_messages, rollout_messages
from stagectl.stage_b.tickets import Ticket

G = Guidance(0, "", {"G0": "judge the group", "G1": "red means fail"})
TICKETS = [
    Ticket("m", "g1", "fail", (("image_1", "red circle"),)),
    Ticket("m", "g2", "pass", (("image_1", "blue square"), ("image_2", "green dot"))),
]


def test_the_model_backend_judges_and_reflects() -> None:
    cfg = load_config(None, ["model.device_map=auto"])
    plan = backend_plan(cfg)  # runner.engine: model, the default
    assert isinstance(plan, ModelBackendPlan)
    engine, note = load_model_backend(plan, World(rank=0, local_rank=0, world_size=1))
    assert "on cpu" in note and "device_map='auto' ignored" in note
    requests = [JudgeRequest(t, G, rollout_messages(G, t, "m"), 0) for t in TICKETS]
    spec = SamplingSpec(temperature=1.0, top_p=0.9, max_new_tokens=6)
    first = engine.judge(requests, spec, 11)
    assert len(first) == 2 and all(isinstance(t, str) for t in first)
    assert engine.judge(requests, spec, 11) == first  # same seed, same answers
    records = [ReflectionRecord(TICKETS[0], "pass", 1, 0, ("fine",))]
    request = ReflectRequest(G, records, reflection_messages(G, records, "m", 2))
    greedy = SamplingSpec(temperature=0.0, top_p=1.0, max_new_tokens=6)
    answer = engine.reflect(request, greedy, 0)
    assert isinstance(answer, str)
    assert engine.reflect(request, greedy, 5) == answer  # greedy ignores the seed
