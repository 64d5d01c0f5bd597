"""Pydantic's validation errors as config problems: each on its dotted key path (a union's variant tag left
out), with what to do about it, and for an unknown key where it belongs (`did you mean ...?`: the same key
in another section, a close key of its own section or of its list entries, else the valid keys)."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from stagectl.config.root import Problem, StagectlConfig


def schema_problems(exc: ValidationError) -> list[Problem]:
    """Each pydantic error as a `Problem` on its dotted config key, with what to do about it."""
    problems = []
    for err in exc.errors():
        loc, model, others = _walk([str(part) for part in err["loc"]])
        path = ".".join(loc) or "<root>"
        kind = err["type"]
        if kind == "extra_forbidden" and (owners := _variants_with(others, loc[-1])):
            message = (
                f"{loc[-1]} belongs to {' / '.join(owners)}, not {_tag_key(model) if model else ''}: "
                f"{_tag(model)}; set that, or remove it"
            )
        elif kind == "extra_forbidden":
            message = "unknown key; remove it" + _did_you_mean(loc[-1], model, loc[:-1])
        elif kind == "missing":
            message = "required; set it"
        elif kind == "literal_error":
            message = f"{err['msg'].lower()}; got {err.get('input')!r}"
        elif kind == "value_error":
            message = str(err["msg"]).removeprefix("Value error, ")
        else:
            message = f"{err['msg']}; got {_short(err.get('input'))}"
        problems.append(Problem(path, message))
    return problems


def _walk(loc: list[str]) -> tuple[list[str], type[BaseModel] | None, list[type[BaseModel]]]:
    """A pydantic error location as a config key path: without the variant tag pydantic inserts below a
    union of sections (`vllm.sync.http.chunk_mb` is the key `vllm.sync.chunk_mb`); plus the section the
    last key sits in and, when that section is a union's variant, the other variants."""
    path: list[str] = []
    model: type[BaseModel] | None = StagectlConfig
    others: list[type[BaseModel]] = []
    i = 0
    while i < len(loc):
        path.append(loc[i])
        if i == len(loc) - 1:
            break
        field = _field(model, loc[i]) if model is not None else None
        variants = model_types(field.annotation) if field is not None else []
        chosen = [m for m in variants if _tag(m) == loc[i + 1]] if len(variants) > 1 else []
        if chosen:
            model, others = chosen[0], [m for m in variants if m is not chosen[0]]
            i += 2  # the tag is no key
            continue
        model, others = (variants[0] if len(variants) == 1 else None), []
        i += 1
    return path, model, others


def _field(model: type[BaseModel], key: str) -> Any:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field
    return None


def _tag_key(model: type[BaseModel]) -> str | None:
    """The key of a union variant whose type is a single-value `Literal` (its tag), if any."""
    for name, field in model.model_fields.items():
        args = getattr(field.annotation, "__args__", ())
        if getattr(field.annotation, "__origin__", None) is Literal and len(args) == 1:
            return name
    return None


def _tag(model: type[BaseModel] | None) -> str:
    key = _tag_key(model) if model is not None else None
    if model is None or key is None:
        return ""
    return str(getattr(model.model_fields[key].annotation, "__args__", ("",))[0])


def _variants_with(variants: list[type[BaseModel]], key: str) -> list[str]:
    """`transport: collective` for each variant that has `key`."""
    return [f"{_tag_key(m)}: {_tag(m)}" for m in variants if _tag_key(m) and _field(m, key) is not None]


# keys a Hugging Face Trainer / TRL config has and stagectl spells otherwise (or does not have): the hint
HF_KEYS = {
    "bf16": "training.mixed_precision: bf16",
    "fp16": "training.mixed_precision: fp16",
    "num_train_epochs": "training.max_steps (stagectl counts optimizer steps, not epochs)",
    "warmup_ratio": "training.warmup_steps (a number of optimizer steps)",
    "save_strategy": "training.save_steps (0: only at the end)",
    "logging_strategy": "training.logging_steps",
    "fsdp": "training.parallelism: fsdp",
    "deepspeed": "training.parallelism: fsdp (stagectl shards with FSDP2, not DeepSpeed)",
}


def _did_you_mean(key: str, model: type[BaseModel] | None, section: list[str]) -> str:
    """Suggest where the unknown key of `section` belongs, as a full dotted path: the same key in another
    section (a top-level `learning_rate` is `training.learning_rate`), else the closest key of its own
    section, else a close key elsewhere."""
    if model is None:
        return ""
    if key in HF_KEYS:
        return f" (the Hugging Face Trainer's {key!r}; here: {HF_KEYS[key]})"
    elsewhere = _key_paths(StagectlConfig)
    exact = sorted((p for p in elsewhere if p.rsplit(".", 1)[-1] == key), key=lambda p: (p.count("."), p))
    if exact:
        return f" (did you mean {_one_of(exact[:3])}?)"
    names = [f.alias or name for name, f in model.model_fields.items()]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {'.'.join([*section, close[0]])!r}?)"
    in_items = _key_of_list_items(key, model)
    if in_items is not None:  # `vllm.server.base_url`: a key of the section's list entries (`servers`)
        entries, item_key = in_items
        return f" (did you mean {'.'.join([*section, entries])!r}, a list of {{{item_key}: ...}} entries?)"
    leaves = {p.rsplit(".", 1)[-1] for p in elsewhere}
    near = difflib.get_close_matches(key, sorted(leaves), n=1, cutoff=0.8)
    if near:
        paths = sorted(
            (p for p in elsewhere if p.rsplit(".", 1)[-1] == near[0]), key=lambda p: (p.count("."), p)
        )
        return f" (did you mean {_one_of(paths[:3])}?)"
    return f" (valid keys: {', '.join(sorted(names))})"


def _key_of_list_items(key: str, model: type[BaseModel]) -> tuple[str, str] | None:
    """(list field of `model`, its entries' key) when `key` is, or is close to, a key of those entries."""
    for name, field in model.model_fields.items():
        if getattr(field.annotation, "__origin__", None) is not list:
            continue
        for item in model_types(field.annotation):
            item_keys = [f.alias or n for n, f in item.model_fields.items()]
            close = [key] if key in item_keys else difflib.get_close_matches(key, item_keys, n=1, cutoff=0.8)
            if close:
                return field.alias or name, close[0]
    return None


def _one_of(paths: list[str]) -> str:
    quoted = [repr(p) for p in paths]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _key_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of `model`'s sections (a union's variants merged; no keys inside list items)."""
    paths: list[str] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{field.alias or name}"
        paths.append(path)
        if getattr(field.annotation, "__origin__", None) in (list, tuple, dict):
            continue
        for sub in model_types(field.annotation):
            paths += [p for p in _key_paths(sub, f"{path}.") if p not in paths]
    return paths


def model_types(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic section types of a field annotation (a union's or an optional's members)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in getattr(annotation, "__args__", ()):
        out += model_types(arg)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
