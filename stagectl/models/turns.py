"""Which token ids end an assistant turn, read from the checkpoint itself (never a hard-coded token).

- The chat template's end-of-turn: render `[user, assistant=PROBE]` with the tokenizer's own template
  and take the first special token after the probe text (`<|im_end|>` for ChatML / Qwen, `<|eot_id|>`
  for Llama 3, `<end_of_turn>` for Gemma, `<|end|>` for Phi-3, `</s>` for Mistral-style templates).
  Templates whose turns end in plain text, or that refuse the probe conversation, have none.
- Every `eos_token_id` of the generation config (a checkpoint may list several: Llama 3.1 lists
  `<|end_of_text|>`, `<|eom_id|>` and `<|eot_id|>`), falling back to the model config's.
- The tokenizer's `eos_token`.

Generation stops at any of them. Nothing here touches the model weights: the vLLM engine reads the
same ids from the checkpoint directory.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

PROBE = "stagectl end-of-turn probe"
GENERATION_CONFIG_FILE = "generation_config.json"


def template_end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template writes right after an assistant message, or None.

    `ValueError` when the tokenizer has no chat template (stagectl talks to chat models only)."""
    if not tokenizer.chat_template:
        raise ValueError(
            "the tokenizer has no chat template; stagectl serves and judges with chat (instruct) "
            "checkpoints, whose tokenizer_config.json or chat_template.jinja carries one"
        )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except (TemplateError, ValueError, TypeError):  # e.g. a template that insists on a system turn
        return None
    assert isinstance(text, str)
    at = text.rfind(PROBE)
    if at < 0:
        return None
    tail = text[at + len(PROBE) :]
    special = {int(i) for i in tokenizer.all_special_ids} | {
        int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    for token in tokenizer.encode(tail, add_special_tokens=False):
        if token in special:
            return int(token)
        if str(tokenizer.decode([token])).strip():  # visible text before any special token: no end-of-turn
            return None
    return None


def as_id_list(value: int | Iterable[int] | None) -> list[int]:
    """`eos_token_id` as written in a config: one id, a list of ids, or nothing."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(i) for i in value]


def generation_eos_ids(path: Path) -> list[int]:
    """`eos_token_id` of the checkpoint's generation config, else of its model config (or text config)."""
    generation = path / GENERATION_CONFIG_FILE
    if generation.is_file():
        ids = as_id_list(json.loads(generation.read_text()).get("eos_token_id"))
        if ids:
            return ids
    config = json.loads((path / "config.json").read_text())
    return as_id_list(config.get("eos_token_id") or (config.get("text_config") or {}).get("eos_token_id"))


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, eos_ids: Iterable[int]) -> tuple[int, list[int]]:
    """`(end_of_turn_id, stop_ids)`: the turn's closing id (the template's, else the first eos id) and
    every id generation stops at, sorted. `ValueError` when the checkpoint names no stop at all."""
    end_of_turn = template_end_of_turn_id(tokenizer)
    eos = list(eos_ids)
    stops = set(eos)
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    if end_of_turn is None:
        if not stops:
            raise ValueError(
                "cannot tell where an answer ends: the chat template closes no turn with a special token "
                "and neither the generation config nor the tokenizer names an eos token"
            )
        end_of_turn = eos[0] if eos else int(tokenizer.eos_token_id)
    stops.add(end_of_turn)
    return end_of_turn, sorted(stops)
