"""Builders shared by test tiers (never import one test module from another): the three image segments
of different grids that the packed-vs-unpacked checks pack, one segment's logits on its own, and the
example count of the property tests, greedy ids through the `hf` engine, the hand-built run dirs the
report page tests render, and a peer that trickles its answer (`trickle_server`, `returns_within`)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from PIL import Image, ImageDraw

from stagectl.collate import CoordGroup, Segment
from stagectl.config.sampling import SamplingSpec
from stagectl.engines.interface import EngineRequest
from stagectl.models.chat import encode_answer_text, encode_prompt, encode_training
from stagectl.models.loading import ModelBundle

ANSWERS = [
    '{"object_1": {"desc": "red circle", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_300|>", "<|coord_400|>"]}}',
    "{}",
    '{"object_1": {"desc": "blue square", "bbox_2d": ["<|coord_10|>", "<|coord_20|>", "<|coord_30|>", '
    '"<|coord_40|>"]}, "object_2": {"desc": "green star", "bbox_2d": ["<|coord_5|>", "<|coord_6|>", '
    '"<|coord_700|>", "<|coord_800|>"]}}',
]
IMAGE_SIZES = [(112, 112), (168, 112), (84, 140)]  # different grids -> different vision token counts

FUZZ_PROFILES = ("ci", "full")


def fuzz_examples(full: int) -> int:
    """Examples per property test. `STAGECTL_FUZZ_PROFILE=full` runs `full` (the property's own count);
    the default `ci` profile (`make test`, `make test-fast`) runs a tenth of it, at least 20, so the inner
    loop stays fast while every run still draws fresh examples. `STAGECTL_FUZZ_EXAMPLES=N` (the long
    fuzzing pass, e.g. 5000) sets N for every property whatever the profile."""
    if os.environ.get("STAGECTL_FUZZ_EXAMPLES"):
        return int(os.environ["STAGECTL_FUZZ_EXAMPLES"])
    profile = os.environ.get("STAGECTL_FUZZ_PROFILE", "ci")
    if profile not in FUZZ_PROFILES:
        raise ValueError(f"STAGECTL_FUZZ_PROFILE={profile!r}: expected one of {', '.join(FUZZ_PROFILES)}")
    return full if profile == "full" else max(20, full // 10)


def image_segments(bundle: ModelBundle) -> list[Segment]:
    """Three Channel-A segments, one image each, of three different lengths."""
    segments = []
    coord_ids = set(bundle.coord_token_ids)
    for k, (size, answer) in enumerate(zip(IMAGE_SIZES, ANSWERS, strict=True)):
        image = Image.new("RGB", size, (40 * k, 120, 200))
        ImageDraw.Draw(image).ellipse((10, 10, 50 + 10 * k, 60), fill=(255, 0, 0))
        prompt = encode_prompt(bundle.tokenizer, bundle.image_processor, [image])
        sample = encode_training(prompt, encode_answer_text(bundle.tokenizer, answer), bundle.end_of_turn_id)
        n, start = len(sample.input_ids), sample.assistant_start
        coord_positions = [t for t in range(start, n) if sample.input_ids[t] in coord_ids]
        groups = [
            CoordGroup(
                tuple(coord_positions[i : i + 4]),  # type: ignore[arg-type]
                tuple(bundle.coord_token_ids.index(sample.input_ids[t]) for t in coord_positions[i : i + 4]),  # type: ignore[arg-type]
            )
            for i in range(0, len(coord_positions), 4)
        ]
        segments.append(
            Segment(
                input_ids=sample.input_ids,
                ce_weights=[0.0] * start + [1.0] * (n - start),
                mm_token_type_ids=sample.mm_token_type_ids,
                pixel_values=sample.pixel_values,
                image_grid_thw=sample.image_grid_thw,
                coord_groups=groups,
            )
        )
    assert len({len(s) for s in segments}) == 3
    return segments


def single_logits(model: torch.nn.Module, segment: Segment, device: str = "cpu") -> torch.Tensor:
    """`segment`'s logits (T, V) from a forward of that segment alone (no packing, no padding)."""
    pixels, grid = segment.pixel_values, segment.image_grid_thw
    out = model(
        input_ids=torch.tensor([segment.input_ids], device=device),
        mm_token_type_ids=torch.tensor([segment.mm_token_type_ids], device=device),
        pixel_values=None if pixels is None else pixels.to(device),
        image_grid_thw=None if grid is None else grid.to(device),
        use_cache=False,
    )
    return out.logits[0]


def _engine_requests() -> list[EngineRequest]:
    rng = np.random.default_rng(0)
    spec = SamplingSpec(max_new_tokens=12, temperature=0.0)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find every object."}]}
    ]
    sizes = ((56, 56), (84, 112), (56, 84))  # different image-token counts: a left-padded batch
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    return [EngineRequest(messages, [image], spec, seed=None) for image in images]


def greedy_engine_ids(bundle: ModelBundle, kv_cache: str) -> tuple[list[list[int]], dict[int, int], set[str]]:
    """Greedy ids of three concurrent image requests through an `hf` engine with `kv_cache`, the engine's
    batch sizes, and the KV cache classes the model decoded with."""
    from stagectl.engines.hf import HFEngine

    engine = HFEngine(bundle, model_name="tiny", max_batch_size=8, batch_wait_ms=200, kv_cache=kv_cache)  # type: ignore[arg-type]
    caches: set[str] = set()  # the cache class each forward decoded with

    def record(_module: object, _args: object, kwargs: dict) -> None:
        caches.add(type(kwargs.get("past_key_values")).__name__)

    hook = bundle.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with ThreadPoolExecutor(3) as pool:  # concurrent callers, one request each
            results = list(pool.map(lambda r: engine.generate([r])[0], _engine_requests()))
        return [r.token_ids for r in results], engine.batch_sizes(), caches
    finally:
        hook.remove()
        engine.close()


def write_report_dirs(root: Path) -> tuple[Path, Path, Path]:
    """A tiny train-ab run dir (with its `eval/` gallery and a Channel-B gallery) and a Stage-B mission dir,
    built by hand from small files (no training): what `stagectl report` reads. Returns (run dir, its eval
    dir, mission dir)."""
    import json

    import yaml

    from stagectl.data.sample import DetectionSample, DetObject
    from stagectl.detection.stats import RolloutStats
    from stagectl.evaluation.core import ImageOutcome
    from stagectl.evaluation.gallery import write_gallery
    from stagectl.learner.channel_b.gallery import BRecord, ObjectVerdict, TargetToken, write_record
    from stagectl.timing import PHASES, phase_key

    run = root / "run"
    ev = run / "eval"
    ev.mkdir(parents=True)
    image = root / "scene.png"
    picture = Image.new("RGB", (320, 240), (235, 235, 220))
    ImageDraw.Draw(picture).ellipse((40, 30, 150, 130), fill=(200, 40, 40))
    ImageDraw.Draw(picture).rectangle((190, 120, 290, 210), fill=(40, 60, 200))
    picture.save(image)
    objects = [DetObject("red circle", (125, 125, 467, 543)), DetObject("blue square", (595, 502, 909, 878))]
    sample = DetectionSample([str(image)], 320, 240, objects)
    rows = []
    for step in range(6):
        kind = "B" if step % 2 else "A"
        row: dict[str, object] = {
            "step": step,
            "kind": kind,
            "policy_wants_b": kind == "B",
            "loss": 3.0 - 0.1 * step,
        }
        row.update({"loss/ce": 2.0 - 0.1 * step, "tokens": 500, "time/step_s": 1.0, "time/wait_s": 0.1})
        row.update({phase_key(p): 0.1 for p in PHASES})
        if kind == "B":
            row.update({"rollout/precision": 0.5, "rollout/recall": 0.4, "rollout/f1": 0.44})
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"stage2_ab": {"schedule": {"b_ratio": 0.5}}, "training": {"max_steps": 6}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "eval.jsonl").write_text(
        json.dumps({"step": 5, "f1": 0.5, "precision": 0.5, "recall": 0.5}) + "\n"
    )
    (run / "final_state.json").write_text("{}\n")
    metrics = {"AP": 0.3, "AP50": 0.5, "f1": 0.5, "n_images": 2, "per_class_ap": {"red circle": 0.3}}
    metrics["pr_curve_iou50"] = {"recall": [0.0, 0.5, 1.0], "precision": [1.0, 0.8, 0.2]}
    (ev / "metrics.json").write_text(json.dumps(metrics))
    (ev / "predictions.coco.json").write_text("[]\n")
    parsed = [
        [{"desc": "red circle", "bbox_2d": [130, 120, 470, 540], "score": 0.91}],
        [{"desc": "green star", "bbox_2d": [10, 700, 200, 950], "score": 0.4}],
    ]
    outcomes = [ImageOutcome(k, RolloutStats(), [], 0, p) for k, p in enumerate(parsed)]
    write_gallery(ev / "gallery", [sample, sample], outcomes, num_images=2, duplicate_iou_threshold=0.7)
    record = BRecord(
        step=3,
        sample=0,
        target_kind="clean_prefix",
        rollout_text='{"object_1": {"desc": "red circle", ...',
        objects=[ObjectVerdict("object_1", "red circle", "matched", 0.93, [130, 120, 470, 540])],
        misses=[{"gt": 1, "desc": "blue square"}],
        tokens=[TargetToken('{"object_1": ', 1.0, False), TargetToken("<|coord_125|>", 1.0, True)],
    )
    write_record(run / "b_gallery", record, sample)
    mission = root / "stage_b" / "mission_a"
    (mission / "snapshots").mkdir(parents=True)
    selections = [
        {
            "epoch": 0,
            "guidance_step": k // 2,
            "label": "pass",
            "verdict": "pass" if k % 3 else "fail",
            "label_match": bool(k % 3),
            "num_pass": 2,
            "num_fail": 0,
            "num_malformed": 0,
        }
        for k in range(6)
    ]
    (mission / "selections.jsonl").write_text("".join(json.dumps(s) + "\n" for s in selections))
    windows = [
        {
            "window": n,
            "epoch": 0,
            "num_batches": 1,
            "guidance_step": n,
            "num_tickets": 3,
            "accuracy": 0.5 + 0.2 * n,
            "fp_rate": 0.1,
            "fn_rate": 0.0,
            "num_fp": 0,
            "num_fn": 0,
            "num_guidance_changes": n,
            "elapsed_s": 1.0,
        }
        for n in range(2)
    ]
    (mission / "metrics.jsonl").write_text("".join(json.dumps(w) + "\n" for w in windows))
    reflection = {
        "records": ["t1"],
        "guidance_step_before": 0,
        "guidance_step_after": 1,
        "changed": True,
        "accepted": [{"op": "add", "key": "G1", "text": "a scratch is a fail"}],
        "dropped": [],
        "merged_duplicates": [],
        "rejected": None,
        "decode_error": None,
        "answer": "add G1: scratches fail",
    }
    (mission / "reflection.jsonl").write_text(json.dumps(reflection) + "\n")
    guidance = {"step": 1, "experiences": {"G0": "look at the edges", "G1": "a scratch is a fail"}}
    (mission / "guidance.json").write_text(json.dumps(guidance))
    (mission / "snapshots" / "guidance-20260101-step000001.json").write_text(json.dumps(guidance))
    return run, ev, mission


T = TypeVar("T")


@contextlib.contextmanager
def loopback_peer(serve: Callable[[socket.socket], None]) -> Iterator[str]:
    """A peer on 127.0.0.1 that runs `serve(connection)` on a thread for each connection it accepts. Yields
    its base URL; on exit it stops accepting and shuts every connection down (so a call it held ends then,
    and `serve`'s reads and writes fail)."""
    listener = socket.create_server(("127.0.0.1", 0))
    peers: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                peer, _ = listener.accept()
                peers.append(peer)
                threading.Thread(target=serve, args=(peer,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for peer in peers:
            with contextlib.suppress(OSError):
                peer.shutdown(socket.SHUT_RDWR)
            peer.close()


@contextlib.contextmanager
def trickle_server(every_s: float = 0.2, head: bytes = b"HTTP/1.1 200 OK\r\n") -> Iterator[str]:
    """A peer that answers `head` to every connection, then sends one more byte every `every_s` until the
    block ends: any per-read timeout above `every_s` never fires. Yields its base URL."""
    stop = threading.Event()

    def trickle(peer: socket.socket) -> None:
        with contextlib.suppress(OSError):
            peer.settimeout(0.5)
            with contextlib.suppress(TimeoutError):
                peer.recv(1 << 20)  # the request head (a long body stays unread: the peer never answers it)
            peer.sendall(head)
            while not stop.wait(every_s):
                peer.sendall(b"x")

    try:
        with loopback_peer(trickle) as url:
            yield url
    finally:
        stop.set()


def returns_within(limit_s: float, call: Callable[[], T]) -> tuple[T, float]:
    """`call()`'s result and its seconds, failing the test (instead of hanging it) when it has not returned
    within `limit_s`; an exception it raises is raised here."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:  # handed to the test thread, which re-raises it
            outcome["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    seconds = time.monotonic() - started
    assert not thread.is_alive(), f"still waiting after {limit_s:g} s: it hangs"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"], seconds  # type: ignore[return-value]
