"""`runner.engine: model`: each rank generates with its own full copy of the model (no sharding).

Prompts are text-only chat messages through the checkpoint's chat template; a `judge` call is one
left-padded `generate` over the rank's shard of the global batch, seeded with the decode's seed.
"""

from __future__ import annotations

from collections.abc import Sequence

from stagectl.config import StagectlConfig
from stagectl.dist import World
from stagectl.models.generate import PromptInputs, SamplingSpec, generate_batch
from stagectl.models.loading import ModelBundle, load_bundle
from stagectl.stage_b.engine import DecodeSpec, JudgeRequest, ReflectRequest, rank_device
from stagectl.stage_b.prompts import Message


class HFEngine:
    def __init__(self, bundle: ModelBundle) -> None:
        self.bundle = bundle
        tokenizer = bundle.tokenizer
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        stops = {bundle.end_of_turn_id}
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        self.stop_token_ids = sorted(stops)

    def judge(self, requests: Sequence[JudgeRequest], spec: DecodeSpec) -> list[str]:
        return self._generate([r.messages for r in requests], spec)

    def reflect(self, request: ReflectRequest, spec: DecodeSpec) -> str:
        return self._generate([request.messages], spec)[0]

    def _generate(self, conversations: Sequence[list[Message]], spec: DecodeSpec) -> list[str]:
        tokenizer = self.bundle.tokenizer
        prompts = []
        for messages in conversations:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert isinstance(text, str)
            prompts.append(PromptInputs(input_ids=tokenizer.encode(text, add_special_tokens=False)))
        sampling = SamplingSpec(
            max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, top_p=spec.top_p
        )
        generations = generate_batch(
            self.bundle.model,
            prompts,
            sampling,
            stop_token_ids=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            seed=spec.seed,
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
    )
    note = f"rank {world.rank}: model {cfg.model.name_or_path} on {device}"
    if cfg.model.device_map is not None:
        note += f" (model.device_map={cfg.model.device_map!r} ignored: one full copy per rank)"
    return HFEngine(bundle), note
