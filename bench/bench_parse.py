"""Rollout parse throughput in tokens/s, on answers tokenized by the tiny tokenizer.

Cases: clean answers of 5, 30 and 100 objects, a 30-object answer truncated mid-object, and a mix of
mutated answers (deleted / inserted / swapped tokens: syntax errors and dropped objects). For
reference, the same ids through `join token bytes + json.loads` (C JSON, no token alignment, no
rules) — the `vs_json_loads` ratio is parse time / that time.

Run: `python -m bench.bench_parse`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

import json
import random
import statistics
import time

from stagectl.detection.parse import parse_rollout
from stagectl.detection.serialize import serialize_objects
from stagectl.detection.vocab import TokenVocab
from stagectl.models.tokenizer import build_tiny_tokenizer

COLOURS = ("red", "green", "blue", "yellow", "purple", "black", "white", "orange")
SHAPES = ("circle", "square", "triangle", "star", "ring", "oval", "box", "diamond")


class _Obj:
    def __init__(self, desc: str, bbox_2d: tuple[int, int, int, int]) -> None:
        self.desc = desc
        self.bbox_2d = bbox_2d


def _answer(rng: random.Random, num_objects: int) -> str:
    objects = []
    for _ in range(num_objects):
        x1, y1 = rng.randrange(900), rng.randrange(900)
        box = (x1, y1, x1 + rng.randrange(1, 99), y1 + rng.randrange(1, 99))
        objects.append(_Obj(f"{rng.choice(COLOURS)} {rng.choice(SHAPES)}", box))
    return serialize_objects(objects)


def _mutate(rng: random.Random, ids: list[int], vocab_size: int) -> list[int]:
    ids = list(ids)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(ids))
        op = rng.choice(["delete", "insert", "swap"])
        if op == "delete":
            del ids[at]
        elif op == "insert":
            ids.insert(at, rng.randrange(vocab_size))
        elif at + 1 < len(ids):
            ids[at], ids[at + 1] = ids[at + 1], ids[at]
    return ids


def _cases(vocab: TokenVocab, encode: object) -> dict[str, list[list[int]]]:
    assert callable(encode)
    rng = random.Random(0)
    eot = vocab.end_of_turn_id
    cases: dict[str, list[list[int]]] = {}
    for n in (5, 30, 100):
        cases[f"clean_{n}_objects"] = [[*encode(_answer(rng, n)), eot] for _ in range(20)]
    truncated = [list(encode(_answer(rng, 30))) for _ in range(20)]
    cases["truncated_30_objects"] = [ids[: rng.randrange(len(ids) // 2, len(ids) - 5)] for ids in truncated]
    clean = [list(encode(_answer(rng, rng.randint(1, 30)))) for _ in range(40)]
    cases["mutated_1_to_30_objects"] = [_mutate(rng, ids, len(vocab.token_bytes)) for ids in clean]
    return cases


def _seconds(fn: object, batch: list[list[int]], repeats: int) -> list[float]:
    assert callable(fn)
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for ids in batch:
            fn(ids)
        out.append(time.perf_counter() - start)
    return out


def _json_loads(ids: list[int], table: list[bytes]) -> object:
    try:
        return json.loads(b"".join(table[i] for i in ids))
    except ValueError:
        return None


def run(repeats: int = 7) -> dict[str, dict[str, float]]:
    tokenizer = build_tiny_tokenizer()
    vocab = TokenVocab.from_tokenizer(tokenizer)
    table = list(vocab.token_bytes)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    results: dict[str, dict[str, float]] = {}
    for name, batch in _cases(vocab, encode).items():
        num_tokens = sum(len(ids) for ids in batch)
        parse_s = _seconds(lambda ids: parse_rollout(ids, vocab), batch, repeats)
        json_s = _seconds(
            lambda ids: _json_loads(ids[:-1] if ids[-1:] == [vocab.end_of_turn_id] else ids, table),
            batch,
            repeats,
        )
        results[name] = {
            "num_rollouts": len(batch),
            "tokens_per_rollout": num_tokens / len(batch),
            "tokens_per_s_min": num_tokens / max(parse_s),
            "tokens_per_s_median": num_tokens / statistics.median(parse_s),
            "tokens_per_s_max": num_tokens / min(parse_s),
            "us_per_rollout_median": statistics.median(parse_s) / len(batch) * 1e6,
            "vs_json_loads": statistics.median(parse_s) / statistics.median(json_s),
        }
    return results


def main() -> None:
    results = run()
    print("parse_rollout throughput (tiny tokenizer)")
    print(
        f"{'case':<26} {'tok/rollout':>11} {'tokens/s min / median / max':>32} {'us/rollout':>10} {'vs json':>8}"
    )
    for name, row in results.items():
        rate = f"{row['tokens_per_s_min']:,.0f} / {row['tokens_per_s_median']:,.0f} / {row['tokens_per_s_max']:,.0f}"
        print(
            f"{name:<26} {row['tokens_per_rollout']:>11.0f} {rate:>32} "
            f"{row['us_per_rollout_median']:>10.0f} {row['vs_json_loads']:>7.1f}x"
        )


if __name__ == "__main__":
    main()
