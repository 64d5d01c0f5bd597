"""Tiny text chat models of other families: Llama 3, Qwen3 and Gemma 3, each with its real chat template.

They stand in for "any instruct checkpoint a team already serves" (Stage-B, plain serving): same model
class, same special tokens and ids layout, same chat template and generation config as the family's
instruct releases, at toy size (hidden 128, 2 layers) with random weights. None of them has the
detection coordinate tokens. Tokenizers are trained on the built-in corpus:

- `llama3`: byte-level BPE with Llama 3's pre-tokenisation regex, `PreTrainedTokenizerFast` (what Llama 3
  checkpoints load as); `<|begin_of_text|>` is prepended on encode; ids after the BPE vocab follow
  Llama 3's order (`<|begin_of_text|>`, `<|end_of_text|>`, 4 reserved, `<|start_header_id|>`,
  `<|end_header_id|>`, 1 reserved, `<|eot_id|>`). The generation config lists only `<|end_of_text|>`,
  as Meta-Llama-3-8B-Instruct's did when first published: that `<|eot_id|>` ends a turn is known from
  the chat template alone.
- `qwen3`: the Qwen2 byte-level BPE and `Qwen2Tokenizer`, Qwen3's special and added tokens (`<think>`,
  `<tool_call>`, ...), Qwen3's generation config (sampling defaults included).
- `gemma3`: a SentencePiece-style BPE (spaces as `▁`, byte fallback `<0x00>`..`<0xFF>`) in
  `GemmaTokenizer`, ids 0..4 = `<pad> <eos> <bos> <unk> <mask>`, `<start_of_turn>` / `<end_of_turn>`;
  a `Gemma3ForCausalLM` (`gemma3_text`) with one sliding-window layer and one full-attention layer.

Heads are untied (vLLM's CPU build keeps a stale packed copy of a tied head after a weight sync) and
weights are drawn with a larger spread than the default init, so greedy outputs vary from token to token.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any, Literal

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.gemma.tokenization_gemma import GemmaTokenizer
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from stagectl.models import chat_templates
from stagectl.models.corpus import corpus
from stagectl.models.tokenizer import (
    BPE_VOCAB_SIZE,
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKENS,
    byte_level_pre_tokenizer,
    token_id,
    train_tiny_bpe,
)

ChatArch = Literal["llama3", "qwen3", "gemma3"]

HIDDEN = 128
LAYERS = 2
HEADS = 2  # head_dim 64
INIT_STD = 0.2  # the default 0.02 gives near-constant greedy outputs

# Llama 3 -------------------------------------------------------------------------------------------
LLAMA3_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
EOT_ID = "<|eot_id|>"
LLAMA3_SPECIAL_TOKENS = (
    BEGIN_OF_TEXT,
    END_OF_TEXT,
    *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    EOT_ID,
)

# Qwen3: special tokens of Qwen2-VL, then the added (non-special) and special tokens Qwen3 appends.
QWEN3_ADDED_TOKENS = (
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Gemma 3 -------------------------------------------------------------------------------------------
GEMMA_PAD, GEMMA_EOS, GEMMA_BOS, GEMMA_UNK, GEMMA_MASK = "<pad>", "<eos>", "<bos>", "<unk>", "<mask>"
START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
GEMMA_SLIDING_WINDOW = 32  # tokens; small, so the sliding-window layer really slides in tests


def build_chat_tokenizer(arch: ChatArch) -> PreTrainedTokenizerBase:
    """The tiny tokenizer of `arch`, chat template included; the same ids on every build."""
    if arch == "llama3":
        return _llama3_tokenizer()
    if arch == "qwen3":
        return _qwen3_tokenizer()
    if arch == "gemma3":
        return _gemma3_tokenizer()
    raise ValueError(f"unknown chat architecture {arch!r}")


def _llama3_tokenizer() -> PreTrainedTokenizerBase:
    vocab, merges = _bpe_once(LLAMA3_PRETOKENIZE_REGEX)
    backend = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges), ignore_merges=True))
    backend.pre_tokenizer = byte_level_pre_tokenizer(LLAMA3_PRETOKENIZE_REGEX)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIAL_TOKENS])
    bos_id = backend.token_to_id(BEGIN_OF_TEXT)
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BEGIN_OF_TEXT} $A",
                pair=f"{BEGIN_OF_TEXT} $A {BEGIN_OF_TEXT}:1 $B:1",
                special_tokens=[(BEGIN_OF_TEXT, bos_id)],
            ),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BEGIN_OF_TEXT,
        eos_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,  # transformers ignores it for byte-level BPE anyway
        model_max_length=131072,
    )
    tokenizer.chat_template = chat_templates.LLAMA3
    return tokenizer


def _qwen3_tokenizer() -> PreTrainedTokenizerBase:
    vocab, merges = _bpe_once(None)
    tokenizer = Qwen2Tokenizer(
        vocab=dict(vocab),
        merges=list(merges),  # type: ignore[arg-type]  # tokenizers' BPE takes (left, right) pairs
        unk_token=None,  # type: ignore[arg-type]  # byte-level: nothing is unknown
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN3_ADDED_TOKENS])
    tokenizer.chat_template = chat_templates.QWEN3
    return tokenizer


def _gemma3_tokenizer() -> PreTrainedTokenizerBase:
    vocab, merges = _gemma_bpe_once()
    tokenizer = GemmaTokenizer(
        vocab=dict(vocab),
        merges=list(merges),  # type: ignore[arg-type]  # tokenizers' BPE takes (left, right) pairs
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (START_OF_TURN, END_OF_TURN)]
    )
    tokenizer.chat_template = chat_templates.GEMMA3
    return tokenizer


@cache
def _bpe_once(regex: str | None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    return train_tiny_bpe() if regex is None else train_tiny_bpe(regex)


@cache
def _gemma_bpe_once() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """SentencePiece-style BPE: spaces become `▁` (merges never cross one), unknown bytes fall back to
    `<0xNN>` tokens; ids 0..4 are Gemma's `<pad> <eos> <bos> <unk> <mask>`, then the 256 byte tokens."""
    bpe = Tokenizer(models.BPE(unk_token=GEMMA_UNK, byte_fallback=True, fuse_unk=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Split(Regex("▁"), behavior="merged_with_next")  # training only
    specials = [GEMMA_PAD, GEMMA_EOS, GEMMA_BOS, GEMMA_UNK, GEMMA_MASK, *(f"<0x{b:02X}>" for b in range(256))]
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=specials,
    )
    bpe.train_from_iterator(corpus(), trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    return dict(model["vocab"]), [(a, b) for a, b in model["merges"]]


def chat_config(arch: ChatArch, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The model config of `arch`, special-token ids taken from `tokenizer`."""
    vocab_size = -(-len(tokenizer) // 64) * 64  # embedding rows padded to a multiple of 64
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": 4 * HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "head_dim": HIDDEN // HEADS,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "initializer_range": INIT_STD,
    }
    if arch == "llama3":
        return LlamaConfig(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            bos_token_id=token_id(tokenizer, BEGIN_OF_TEXT),
            eos_token_id=token_id(tokenizer, END_OF_TEXT),
        )
    if arch == "qwen3":
        return Qwen3Config(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=token_id(tokenizer, ENDOFTEXT),
            eos_token_id=token_id(tokenizer, IM_END),
        )
    if arch == "gemma3":
        return Gemma3TextConfig(
            **common,
            query_pre_attn_scalar=HIDDEN // HEADS,
            sliding_window=GEMMA_SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            pad_token_id=token_id(tokenizer, GEMMA_PAD),
            bos_token_id=token_id(tokenizer, GEMMA_BOS),
            eos_token_id=[token_id(tokenizer, GEMMA_EOS), token_id(tokenizer, END_OF_TURN)],
        )
    raise ValueError(f"unknown chat architecture {arch!r}")


def chat_generation_config(arch: ChatArch, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """The generation config the family's instruct checkpoints ship (ids from `tokenizer`)."""
    if arch == "llama3":
        return GenerationConfig(
            bos_token_id=token_id(tokenizer, BEGIN_OF_TEXT), eos_token_id=token_id(tokenizer, END_OF_TEXT)
        )
    if arch == "qwen3":
        pad = token_id(tokenizer, ENDOFTEXT)
        return GenerationConfig(
            bos_token_id=pad,
            eos_token_id=[token_id(tokenizer, IM_END), pad],
            pad_token_id=pad,
            do_sample=True,
            temperature=0.6,
            top_k=20,
            top_p=0.95,
        )
    return GenerationConfig(
        bos_token_id=token_id(tokenizer, GEMMA_BOS),
        eos_token_id=[token_id(tokenizer, GEMMA_EOS), token_id(tokenizer, END_OF_TURN)],
        pad_token_id=token_id(tokenizer, GEMMA_PAD),
        do_sample=True,
        top_k=64,
        top_p=0.95,
    )


def chat_model_class(arch: ChatArch) -> type[PreTrainedModel]:
    if arch == "llama3":
        return LlamaForCausalLM
    if arch == "qwen3":
        return Qwen3ForCausalLM
    return Gemma3ForCausalLM
