"""What train-ab needs of a checkpoint, read from its files without torch or a model load: a Qwen-VL
model (`config.json` names a Qwen-VL `model_type` and has a `vision_config`) that ships its image
processor (`preprocessor_config.json`) and whose chat template compiles (with transformers' own Jinja compiler,
which needs no torch). Any other model loads, serves and judges text, but stagectl can
put images into its prompts and pack its samples only for Qwen-VL (`stagectl.models.qwen_vl`).

`detection_model_problem` is asked before any weight loads: by `stagectl doctor` (`model.load`), by
train-ab's launcher before the run directory or a server exists, and by each rank before it loads the
model (a built-in model that is only built there)."""

from __future__ import annotations

import json
from pathlib import Path

QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def detection_model_problem(checkpoint: Path) -> str | None:
    """Why train-ab cannot train the checkpoint directory `checkpoint` (its `config.json` is read), or None."""
    try:
        config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{checkpoint}/config.json cannot be read: {exc}"
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(config, dict) or "vision_config" not in config:
        return (
            f"{checkpoint} is a text-only {model_type or 'unknown'} model (config.json has no vision_config): "
            "train-ab trains detection on images and needs a Qwen-VL model"
        )
    if model_type not in QWEN_VL_MODEL_TYPES:
        return (
            f"{checkpoint} is a {model_type} vision-language model: train-ab can put images into prompts and "
            f"pack samples only for {', '.join(QWEN_VL_MODEL_TYPES)}"
        )
    if not (checkpoint / IMAGE_PROCESSOR_FILE).is_file():
        return f"{checkpoint} has no {IMAGE_PROCESSOR_FILE}: train-ab needs the checkpoint's image processor"
    return chat_template_problem(checkpoint)


def chat_template_problem(checkpoint: Path) -> str | None:
    """Why the checkpoint's chat template (`chat_template.jinja`, else `tokenizer_config.json`'s
    `chat_template` text) does not compile, as transformers compiles it when the first prompt is rendered
    (after the model has loaded); None when it compiles or there is none to read here."""
    from jinja2 import TemplateError, TemplateSyntaxError

    try:  # transformers' own compiler (its chat-template module imports no torch); private, hence guarded
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    where = checkpoint / "chat_template.jinja"
    try:
        if where.is_file():
            text: object = where.read_text(encoding="utf-8")
        else:
            where = checkpoint / "tokenizer_config.json"
            text = json.loads(where.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None  # the tokenizer's own loading reports an unreadable file
    if not isinstance(text, str):
        return None
    try:
        _compile_jinja_template(text)
    except TemplateError as exc:
        line = f" (line {exc.lineno})" if isinstance(exc, TemplateSyntaxError) else ""
        return f"{where}: the chat template does not compile{line}: {exc.message or exc}"
    return None


def model_problem_on_disk(name_or_path: str) -> str | None:
    """`detection_model_problem` of `model.name_or_path` when its files are on disk; None when they are
    not (a built-in model not built yet, a path that is not a checkpoint): the rank that resolves the
    name builds it, or says what is wrong, and asks again."""
    from stagectl.memory.from_config import checkpoint_dir  # torch-free, as this module

    try:
        checkpoint = checkpoint_dir(name_or_path)
    except ValueError:
        return None
    return detection_model_problem(checkpoint)


def template_problem_on_disk(name_or_path: str) -> str | None:
    """`chat_template_problem` of `model.name_or_path` when its files are on disk (any model: what a rollout
    server serves); None when they are not (see `model_problem_on_disk`)."""
    from stagectl.memory.from_config import checkpoint_dir

    try:
        checkpoint = checkpoint_dir(name_or_path)
    except ValueError:
        return None
    return chat_template_problem(checkpoint)
