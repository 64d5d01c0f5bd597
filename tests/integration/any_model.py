"""Shared by the any-checkpoint tests (integration and vLLM tiers): tiny models of five families and a
copy of each whose greedy answer ends, a few tokens in, with the family's end-of-turn token.

A random tiny model rarely says its end-of-turn token, so a stop could never be observed. `plant_end_of_turn`
takes the model's greedy answer to a fixed prompt, picks its k-th token `t` (k >= 2, first occurrence,
not a stop id) and swaps the output-head rows of `t` and the end-of-turn token. Every logit vector is
then the same numbers with two entries exchanged, so greedy decoding is unchanged for the first k
tokens and says end-of-turn exactly where it would have said `t`. Heads are untied in every tiny model,
so the prompt's embeddings are untouched. A server that stops at the right id answers
`answer[:k] + [end_of_turn]` with finish reason `stop`; one that misses the id keeps going.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw

from stagectl.models.chat import encode_messages
from stagectl.models.generate import PromptInputs, SamplingSpec, generate_batch
from stagectl.models.loading import ModelBundle, load_bundle

TEXT_ARCHS = ("llama3", "qwen3", "gemma3")
VL_ARCHS = ("qwen2.5-vl", "qwen3-vl")
ARCHS = (*TEXT_ARCHS, *VL_ARCHS)
# What each family's checkpoint says ends a turn (its chat template) and where generation stops
# (that plus every eos id). Llama 3's generation config lists only <|end_of_text|>.
END_OF_TURN = {
    "llama3": "<|eot_id|>",
    "qwen3": "<|im_end|>",
    "gemma3": "<end_of_turn>",
    "qwen2.5-vl": "<|im_end|>",
    "qwen3-vl": "<|im_end|>",
}
STOPS = {
    "llama3": {"<|eot_id|>", "<|end_of_text|>"},
    "qwen3": {"<|im_end|>", "<|endoftext|>"},
    "gemma3": {"<end_of_turn>", "<eos>"},
    "qwen2.5-vl": {"<|im_end|>", "<|endoftext|>"},
    "qwen3-vl": {"<|im_end|>", "<|endoftext|>"},
}
QUESTION = "Describe the image. What objects do you see?"
MAX_TOKENS = 16
PLANT_AT = 3  # the answer's first token index that may be replaced by the end-of-turn


def sample_image() -> Image.Image:
    image = Image.new("RGB", (112, 84), (30, 120, 200))
    ImageDraw.Draw(image).ellipse((10, 10, 60, 50), fill=(255, 0, 0))
    return image


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def request_messages(arch: str) -> list[dict[str, Any]]:
    """The chat the tests send, as the server's engines see it (template-ready)."""
    if arch in VL_ARCHS:
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return [{"role": "user", "content": QUESTION}]


def infer_body(arch: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """The same chat as a swift-rollout `/infer/` body (`<image>` tag + inline image for VLMs)."""
    if arch in VL_ARCHS:
        request = {
            "messages": [{"role": "user", "content": "<image>" + QUESTION}],
            "images": [data_url(sample_image())],
        }
    else:
        request = {"messages": [{"role": "user", "content": QUESTION}]}
    config = {"max_tokens": max_tokens, "temperature": 0.0, "return_details": True}
    return {"infer_requests": [request], "request_config": config}


def prompt_of(bundle: ModelBundle, arch: str) -> PromptInputs:
    images = [sample_image()] if arch in VL_ARCHS else []
    return encode_messages(
        bundle.tokenizer, bundle.image_processor, request_messages(arch), images, model_type=bundle.model_type
    )


def greedy(
    bundle: ModelBundle, prompt: PromptInputs, stop_token_ids: list[int], max_new_tokens: int = MAX_TOKENS
) -> list[int]:
    pad = bundle.tokenizer.pad_token_id
    (generation,) = generate_batch(
        bundle.model,
        [prompt],
        SamplingSpec(max_new_tokens=max_new_tokens, temperature=0.0),
        stop_token_ids=stop_token_ids,
        pad_token_id=int(pad if pad is not None else stop_token_ids[0]),
    )
    return generation.token_ids


@dataclass
class Planted:
    arch: str
    path: Path  # the planted checkpoint
    end_of_turn_id: int
    expected: list[int]  # greedy answer: k ordinary tokens, then the end-of-turn id
    stop_token_ids: list[int] = field(default_factory=list)


def plant_end_of_turn(arch: str, out: Path) -> Planted:
    """Write a copy of `builtin:tiny-{arch}` to `out` whose greedy answer ends with the end-of-turn
    token after `PLANT_AT` or more tokens (see the module docstring)."""
    bundle = load_bundle(f"builtin:tiny-{arch}", add_coord_tokens=False)
    tokenizer = bundle.tokenizer
    eot = int(tokenizer.convert_tokens_to_ids(END_OF_TURN[arch]))
    prompt = prompt_of(bundle, arch)
    free = greedy(bundle, prompt, bundle.stop_token_ids)
    special = set(bundle.stop_token_ids) | set(tokenizer.all_special_ids)
    k = next(k for k in range(PLANT_AT, len(free)) if free[k] not in free[:k] and free[k] not in special)
    head = bundle.model.get_output_embeddings()
    assert head is not None
    weight = head.weight  # (V, hidden)
    assert weight.data_ptr() != bundle.model.get_input_embeddings().weight.data_ptr(), "tied head"
    with torch.no_grad():
        rows = weight[[eot, free[k]]].clone()
        weight[[free[k], eot]] = rows
    expected = [*free[:k], eot]
    assert greedy(bundle, prompt, bundle.stop_token_ids) == expected, "a near-tie moved the greedy path"
    bundle.model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if bundle.image_processor is not None:
        bundle.image_processor.save_pretrained(out)
    return Planted(arch, out, eot, expected, list(bundle.stop_token_ids))


# ------------------------------------------------------------------ a judge that answers in format

MISSION = "qc"
JUDGE_ANSWER = "Verdict: fail\nReason: the label is missing."
RULE = "check the label"


def stage_b_inputs(root: Path) -> tuple[Path, Path]:
    """Three tickets (g1 fail, g2 pass, g3 fail) and a starting guidance, written under `root`."""
    rows = [
        {"mission": MISSION, "group_id": gid, "label": label, "per_image": {"image_1": summary}}
        for gid, label, summary in (
            ("g1", "fail", "red square, no label"),
            ("g2", "pass", "blue circle with a label"),
            ("g3", "fail", "green star, label torn"),
        )
    ]
    tickets = root / "tickets.jsonl"
    tickets.write_text("".join(json.dumps(r) + "\n" for r in rows))
    guidance = root / "guidance.json"
    experiences = {"G0": "judge the group", "G1": "red means fail"}
    guidance.write_text(json.dumps({"step": 0, "updated_at": "", "experiences": experiences}))
    return tickets, guidance


def train_judge(arch: str, tickets_path: Path, guidance_path: Path, out: Path, max_steps: int = 200) -> Path:
    """A copy of `builtin:tiny-{arch}` taught (a few Adam steps on the exact prompts) to judge every
    ticket `JUDGE_ANSWER` and to answer the reflection about the mis-judged pass ticket with one valid
    `add` operation, each followed by the family's end-of-turn token. Written to `out`."""
    from stagectl.models.chat import chat_template_ids
    from stagectl.stage_b.guidance_store import read_guidance_file
    from stagectl.stage_b.prompts import ReflectionRecord, reflection_messages, rollout_messages
    from stagectl.stage_b.tickets import load_tickets
    from stagectl.stage_b.verdict import parse_verdict

    bundle = load_bundle(f"builtin:tiny-{arch}", add_coord_tokens=False)
    tokenizer = bundle.tokenizer
    end_of_turn = int(tokenizer.convert_tokens_to_ids(END_OF_TURN[arch]))  # the family's, not the loader's
    guidance = read_guidance_file(guidance_path)
    tickets = load_tickets([tickets_path], MISSION).tickets
    wrong = next(t for t in tickets if t.label == "pass")
    reason = parse_verdict(JUDGE_ANSWER).reason
    record = ReflectionRecord(wrong, "fail", 0, 1, (reason,) if reason else ())
    reflection = json.dumps({"operations": [{"op": "add", "text": RULE, "evidence": [wrong.key]}]})
    examples = [(rollout_messages(guidance, t, MISSION), JUDGE_ANSWER) for t in tickets]
    examples.append((reflection_messages(guidance, [record], MISSION, 2), reflection))
    sequences = [
        (
            chat_template_ids(tokenizer, list(messages)),
            [*tokenizer.encode(answer, add_special_tokens=False), end_of_turn],
        )
        for messages, answer in examples
    ]
    model = bundle.model
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(max_steps):
        optimizer.zero_grad()
        total = 0.0
        for prompt, answer in sequences:
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(answer))
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        if total < 0.01 * len(sequences):
            break
    model.eval()
    for prompt, answer in sequences:  # every answer is now the greedy one, up to the end-of-turn
        assert greedy(bundle, PromptInputs(prompt), [end_of_turn], 4 * len(answer)) == answer, arch
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if bundle.image_processor is not None:
        bundle.image_processor.save_pretrained(out)
    return out
