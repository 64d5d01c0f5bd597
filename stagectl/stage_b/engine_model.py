"""`runner.engine: model`: each rank generates with its own full copy of the model (no sharding), through
the one inference engine (`engines.interface.Engine`; here the `hf` engine, as a rollout server runs it).

Any chat checkpoint transformers can load serves as the judge, loaded unchanged (no coordinate tokens).
Prompts are text-only chat messages through the checkpoint's own chat template; answers end at its
stop ids (the template's end-of-turn and every eos id). A `judge` call is one `generate` over the rank's
shard of the global batch; request i is sampled with `seed + i`, as a server samples it (`engine: server`).
"""

from __future__ import annotations

from collections.abc import Sequence

from stagectl.config.plan_stage_b import ModelBackendPlan
from stagectl.config.sampling import SamplingSpec
from stagectl.dist import World
from stagectl.engines.interface import Engine, EngineRequest
from stagectl.stage_b.engine import JudgeRequest, ReflectRequest, rank_device
from stagectl.stage_b.prompts import Message
from stagectl.wire.guards import TooManyTokens


class ModelBackend:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def judge(self, requests: Sequence[JudgeRequest], spec: SamplingSpec, seed: int) -> list[str]:
        try:
            return self._generate([r.messages for r in requests], spec, seed)
        except TooManyTokens as exc:  # one ticket's prompt: name it, as a bad ticket line is named
            if exc.index is None:
                raise
            raise ValueError(
                f"ticket {requests[exc.index].ticket.key}: its rollout prompt (the guidance and its summaries) "
                f"does not fit the model: {exc}. Shorten its summaries (or lower the sampler's max_new_tokens), "
                "then continue with --resume"
            ) from None

    def reflect(self, request: ReflectRequest, spec: SamplingSpec, seed: int) -> str:
        try:
            return self._generate([request.messages], spec, seed)[0]
        except TooManyTokens as exc:
            keys = ", ".join(r.ticket.key for r in request.records)
            raise ValueError(
                f"the reflection prompt over tickets {keys} does not fit the model: {exc}. Lower "
                "reflection.batch_size or reflection.max_new_tokens, then continue with --resume"
            ) from None

    def close(self) -> None:
        """Ends the engine's batching thread (after the generate it is running)."""
        self.engine.close()

    def _generate(self, conversations: Sequence[list[Message]], spec: SamplingSpec, seed: int) -> list[str]:
        requests = [
            EngineRequest(messages=[dict(m) for m in messages], images=[], params=spec, seed=seed + i)
            for i, messages in enumerate(conversations)
        ]
        return [result.text for result in self.engine.generate(requests)]


def load_model_backend(plan: ModelBackendPlan, world: World) -> tuple[ModelBackend, str]:
    """The rank's backend (the `hf` engine over the rank's copy of `plan.model`) and a one-line note of
    where the model went.

    `model.device_map` is not used: under torchrun every rank loads the full model on its local device
    (a sharded map would make ranks fight over the same GPUs); a single process uses the first device.
    """
    import torch

    from stagectl.engines.hf import HFEngine
    from stagectl.models.loading import load_bundle

    device = rank_device(world, torch.cuda.is_available())
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    model = plan.model
    bundle = load_bundle(
        model.name_or_path,
        torch_dtype=model.torch_dtype,
        device=device,
        attn_implementation=model.attn_implementation,
        add_coord_tokens=False,
    )
    note = f"rank {world.rank}: model {model.name_or_path} on {device}"
    if model.device_map is not None:
        note += f" (model.device_map={model.device_map!r} ignored: one full copy per rank)"
    # one batch per call: a judge call is the rank's shard, at most per_rank_rollout_batch_size requests
    engine = HFEngine(
        bundle,
        model_name=model.name_or_path,
        max_batch_size=plan.max_batch_size,
        batch_wait_ms=10,
    )
    return ModelBackend(engine), note
