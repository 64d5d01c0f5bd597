"""`runner.engine: model`: each rank generates with its own full copy of the model (no sharding).

Any chat checkpoint transformers can load serves as the judge, loaded unchanged (no coordinate tokens).
Prompts are text-only chat messages through the checkpoint's own chat template; answers end at its
stop ids (the template's end-of-turn and every eos id). A `judge` call is one left-padded `generate`
over the rank's shard of the global batch, seeded with the decode's seed.
"""

from __future__ import annotations

from collections.abc import Sequence

from stagectl.config import StagectlConfig
from stagectl.dist import World
from stagectl.models.chat import chat_template_ids
from stagectl.models.generate import PromptInputs, generate_batch
from stagectl.models.loading import ModelBundle, load_bundle
from stagectl.models.sampling import SamplingSpec
from stagectl.stage_b.engine import JudgeRequest, ReflectRequest, rank_device
from stagectl.stage_b.prompts import Message


class HFEngine:
    def __init__(self, bundle: ModelBundle) -> None:
        self.bundle = bundle
        self.stop_token_ids = list(bundle.stop_token_ids)
        pad = bundle.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.stop_token_ids[0])  # Llama 3 has no pad

    def judge(self, requests: Sequence[JudgeRequest], spec: SamplingSpec, seed: int) -> list[str]:
        return self._generate([r.messages for r in requests], spec, seed)

    def reflect(self, request: ReflectRequest, spec: SamplingSpec, seed: int) -> str:
        return self._generate([request.messages], spec, seed)[0]

    def _generate(self, conversations: Sequence[list[Message]], spec: SamplingSpec, seed: int) -> list[str]:
        tokenizer = self.bundle.tokenizer
        prompts = [PromptInputs(chat_template_ids(tokenizer, list(messages))) for messages in conversations]
        generations = generate_batch(
            self.bundle.model,
            prompts,
            spec,
            stop_token_ids=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            seed=seed,
        )
        return [str(tokenizer.decode(g.token_ids, skip_special_tokens=True)) for g in generations]


def load_hf_engine(cfg: StagectlConfig, world: World) -> tuple[HFEngine, str]:
    """The rank's engine and a one-line note of where the model went.

    `model.device_map` is not used: under torchrun every rank loads the full model on its local device
    (a sharded map would make ranks fight over the same GPUs); a single process uses the first device.
    """
    import torch

    device = rank_device(world, torch.cuda.is_available())
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    bundle = load_bundle(
        cfg.model.name_or_path,
        torch_dtype=cfg.model.torch_dtype,
        device=device,
        attn_implementation=cfg.model.attn_implementation,
        add_coord_tokens=False,
    )
    note = f"rank {world.rank}: model {cfg.model.name_or_path} on {device}"
    if cfg.model.device_map is not None:
        note += f" (model.device_map={cfg.model.device_map!r} ignored: one full copy per rank)"
    return HFEngine(bundle), note
