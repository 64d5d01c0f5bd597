"""Model checks: the tokenizer's chat template and stop ids (`model.chat_template`), the coordinate tokens
(`model.coord_tokens`), whether train-ab can train the model at all (`model.load`, from its files: the rule
train-ab applies before it writes anything, `stagectl.models.capability`), then the weights load as train-ab
loads them (`model.load`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from stagectl.config.engines import ENGINES
from stagectl.config.model_data import ModelConfig
from stagectl.doctor.report import Check, fail, ok, warn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from stagectl.models.loading import ModelBundle

MODEL_FIX = "set model.name_or_path to a local Qwen-VL checkpoint directory or builtin:tiny-qwen2.5-vl"


def check_tokenizer(model: ModelConfig, rollout_engine: str | None) -> tuple[bool, list[Check]]:
    """Chat template, stop ids and coordinate tokens, from the checkpoint's tokenizer as it is on disk;
    `rollout_engine`: the engine Channel-B's rollout servers run (None: rollouts run in the learner).
    Returns whether loading the weights is worth trying, and the lines (a `model.load` fail among them
    when train-ab would refuse the model)."""
    from stagectl.models.capability import detection_model_problem
    from stagectl.models.loading import checkpoint_stop_ids, load_tokenizer, resolve_model_path
    from stagectl.models.turns import template_end_of_turn_id

    name = model.name_or_path
    try:
        path = resolve_model_path(name)
        tokenizer = load_tokenizer(name, add_coord_tokens=False)
    except (FileNotFoundError, ValueError, OSError) as exc:
        return False, [fail("model.load", f"model.name_or_path {name}: {exc}", MODEL_FIX)]
    try:
        end_of_turn, stops = checkpoint_stop_ids(path, tokenizer)
    except ValueError as exc:
        return False, [
            fail(
                "model.chat_template",
                f"{path}: {exc}",
                "use the instruct (chat) checkpoint, whose tokenizer_config.json or chat_template.jinja has "
                "the chat template, and a generation_config.json naming eos_token_id",
            )
        ]
    shown = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)} ({i})" for i in stops)
    if template_end_of_turn_id(tokenizer) is None:
        chat = warn(
            "model.chat_template",
            f"the chat template closes no turn with a special token; answers end at eos {end_of_turn}, "
            f"rollouts stop at {shown}",
            "use a chat checkpoint whose template ends assistant turns with a special token (Qwen: <|im_end|>)",
        )
    else:
        chat = ok(
            "model.chat_template",
            f"end of turn {tokenizer.convert_ids_to_tokens(end_of_turn)} ({end_of_turn}); rollouts stop at {shown}",
        )
    lines = [chat, _coord_tokens(name, rollout_engine, tokenizer)]
    problem = detection_model_problem(path)  # train-ab's own refusal, before it loads a weight
    if problem is not None:
        return False, [*lines, fail("model.load", f"model.name_or_path {name}: {problem}", MODEL_FIX)]
    return True, lines


def _coord_tokens(name_or_path: str, rollout_engine: str | None, tokenizer: PreTrainedTokenizerBase) -> Check:
    from stagectl.models.tokenizer import coord_token_ids

    name = "model.coord_tokens"
    try:
        ids = coord_token_ids(tokenizer)
    except ValueError as exc:
        if rollout_engine is not None and not ENGINES[rollout_engine].adds_coord_tokens:
            return fail(
                name,
                f"{exc}: a vLLM rollout server serves the checkpoint as it is and refuses detection without them",
                f"`stagectl export {name_or_path} OUT --add-coord-tokens`, then set "
                "model.name_or_path to OUT for the learner and the servers",
            )
        return warn(
            name,
            f"{exc}: train-ab adds the 1000 tokens with fresh embeddings, so Channel-B rollouts emit no "
            "usable boxes until Channel-A has taught them",
            "start from a checkpoint that already has them (a Stage-1 / SFT checkpoint, or "
            "`stagectl export ... --add-coord-tokens` and a short Channel-A-only run)",
        )
    return ok(name, f"<|coord_0|>..<|coord_999|> present (ids {ids[0]}..{ids[-1]})")


def load_model(model: ModelConfig, device: str) -> tuple[ModelBundle | None, Check]:
    """The model as train-ab loads it: float32 master weights, coordinate tokens added when missing (a model
    train-ab cannot train is refused before, by `check_tokenizer`)."""
    from stagectl.models.loading import load_bundle

    started = time.perf_counter()
    try:
        bundle = load_bundle(
            model.name_or_path,
            torch_dtype="float32",
            device=device,
            attn_implementation=model.attn_implementation,  # as train-ab loads it
            add_coord_tokens=True,
        )
    except (FileNotFoundError, ValueError, OSError) as exc:
        return None, fail("model.load", f"model.name_or_path {model.name_or_path}: {exc}", MODEL_FIX)
    seconds = time.perf_counter() - started
    num_params = sum(p.numel() for p in bundle.model.parameters())
    return bundle, ok(
        "model.load",
        f"{bundle.model_type} from {bundle.path}: {num_params / 1e6:,.1f} M parameters in {seconds:.1f} s on {device}",
    )
