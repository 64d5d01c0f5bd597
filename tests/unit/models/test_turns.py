"""The tiny chat tokenizers render exactly what their families' real chat templates render, and the
end-of-turn / stop ids are read from the checkpoint (template + generation config), never hard-coded."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from stagectl.models.tiny_chat import ChatArch, build_chat_tokenizer
from stagectl.models.turns import generation_eos_ids, stop_token_ids, template_end_of_turn_id

CHAT = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
EXCHANGE = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


@pytest.fixture(scope="module")
def toks() -> dict[ChatArch, PreTrainedTokenizerBase]:
    return {arch: build_chat_tokenizer(arch) for arch in ("llama3", "qwen3", "gemma3")}


def render(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], **kwargs: object) -> str:
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def test_llama3_renders_like_meta_llama_3_instruct(toks: dict[ChatArch, PreTrainedTokenizerBase]) -> None:
    tok = toks["llama3"]
    head = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
    user = "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
    assert render(tok, CHAT, add_generation_prompt=True) == (
        head + user + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render(tok, [{"role": "user", "content": "  U \n"}]) == "<|begin_of_text|>" + user  # trimmed
    ids = tok.encode(render(tok, CHAT), add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert tok.encode("U")[0] == ids[0]  # encode() prepends <|begin_of_text|> like Llama 3


def test_qwen3_renders_like_qwen3(toks: dict[ChatArch, PreTrainedTokenizerBase]) -> None:
    tok = toks["qwen3"]
    prompt = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert render(tok, CHAT, add_generation_prompt=True) == prompt
    assert render(tok, CHAT, add_generation_prompt=True, enable_thinking=False) == (
        prompt + "<think>\n\n</think>\n\n"
    )
    assert render(tok, EXCHANGE) == (
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n"
    )
    think = [EXCHANGE[0], {"role": "assistant", "content": "<think>\nhm\n</think>\n\nA"}]
    assert render(tok, think).endswith("<|im_start|>assistant\n<think>\nhm\n</think>\n\nA<|im_end|>\n")
    assert tok.convert_tokens_to_ids("<think>") not in tok.all_special_ids  # added, not special (as Qwen3)


def test_gemma3_renders_like_gemma_3_instruct(toks: dict[ChatArch, PreTrainedTokenizerBase]) -> None:
    tok = toks["gemma3"]
    assert render(tok, CHAT, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n"  # system folded into user
    )
    assert (
        render(tok, EXCHANGE)
        == "<bos><start_of_turn>user\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
    )
    with pytest.raises(Exception, match="must alternate"):
        render(tok, [EXCHANGE[0], EXCHANGE[0]])
    text = "a  b\n\tü ☃"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte fallback round trip


@pytest.mark.parametrize(
    ("arch", "end_of_turn", "eos_tokens", "stops"),
    [
        ("llama3", "<|eot_id|>", ["<|end_of_text|>"], {"<|eot_id|>", "<|end_of_text|>"}),
        ("qwen3", "<|im_end|>", ["<|im_end|>", "<|endoftext|>"], {"<|im_end|>", "<|endoftext|>"}),
        ("gemma3", "<end_of_turn>", ["<eos>", "<end_of_turn>"], {"<eos>", "<end_of_turn>"}),
    ],
)
def test_stop_ids_come_from_the_template_and_every_eos(
    toks: dict[ChatArch, PreTrainedTokenizerBase],
    arch: ChatArch,
    end_of_turn: str,
    eos_tokens: list[str],
    stops: set[str],
) -> None:
    tok = toks[arch]
    assert tok.convert_ids_to_tokens(template_end_of_turn_id(tok)) == end_of_turn
    eot, ids = stop_token_ids(tok, [tok.convert_tokens_to_ids(t) for t in eos_tokens])
    assert tok.convert_ids_to_tokens(eot) == end_of_turn
    assert set(tok.convert_ids_to_tokens(ids)) == stops and ids == sorted(ids)


def test_templates_without_an_end_of_turn_token(toks: dict[ChatArch, PreTrainedTokenizerBase]) -> None:
    tok = copy.deepcopy(toks["llama3"])
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    assert template_end_of_turn_id(tok) is None  # turns end in plain text
    end_of_text = tok.convert_tokens_to_ids("<|end_of_text|>")
    assert stop_token_ids(tok, [end_of_text]) == (end_of_text, [end_of_text])
    tok.chat_template = "{{ raise_exception('only one turn') }}"
    assert template_end_of_turn_id(tok) is None  # a template that refuses the probe
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        template_end_of_turn_id(tok)


def test_no_stop_at_all_is_an_error(toks: dict[ChatArch, PreTrainedTokenizerBase]) -> None:
    tok = copy.deepcopy(toks["gemma3"])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.eos_token = None
    with pytest.raises(ValueError, match="cannot tell where an answer ends"):
        stop_token_ids(tok, [])


def test_generation_eos_ids(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 7}}))
    assert generation_eos_ids(tmp_path) == [7]  # a VLM's nested text config
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert generation_eos_ids(tmp_path) == [5, 6]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 2]}))
    assert generation_eos_ids(tmp_path) == [1, 106, 2]  # every one of them, generation config first


# Gemma 2's template (gemma-2-2b-it): no system role at all.
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


def test_a_template_without_a_system_role_gets_it_folded_into_the_user_turn(
    toks: dict[ChatArch, PreTrainedTokenizerBase],
) -> None:
    from jinja2 import TemplateError

    from stagectl.models.chat import chat_template_ids

    tok = copy.deepcopy(toks["gemma3"])
    tok.chat_template = GEMMA2
    expected = "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n"
    assert tok.decode(chat_template_ids(tok, CHAT)) == expected  # what Stage-B prompts look like
    assert tok.convert_ids_to_tokens(template_end_of_turn_id(tok)) == "<end_of_turn>"
    with pytest.raises(TemplateError, match="must alternate"):  # other template errors still surface
        chat_template_ids(tok, [EXCHANGE[0], EXCHANGE[0]])
