"""`stagectl eval` end to end, over the `EvalSession` the command resolved: check every input before any
work (data, ids, output directory, checkpoint or server), generate this rank's shard, merge on rank 0,
write the files once at the end. Bad input is a `ValueError` naming what and where; nothing is written
unless the eval completes."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagectl.config.plan import EvalPlan
from stagectl.config.plan_eval import EvalSession
from stagectl.console import say
from stagectl.data.jsonl import load_jsonl_dataset
from stagectl.data.sample import DetectionSample
from stagectl.data.synthetic import generate_synthetic
from stagectl.evaluation.coco import assign_ids
from stagectl.evaluation.core import EvalReport, ImageOutcome, summarize
from stagectl.evaluation.gallery import GALLERY_DIR, write_gallery
from stagectl.evaluation.run import (
    EvalProgress,
    in_process_generate,
    judge_chunks,
    served_weights,
    server_generate,
    shard_chunks,
    weights_changed_line,
    write_report,
)


def load_eval_samples(plan: EvalPlan | None) -> tuple[list[DetectionSample], int, str]:
    """(the first `data.eval.max_samples` samples of the eval split, all of them when it is None; how many
    it has; what it is); `plan` None: the config has no `data.eval`."""
    if plan is None:
        return [], 0, "no data.eval"
    ev = plan.data
    if ev.synthetic is not None:
        syn = ev.synthetic
        samples = generate_synthetic(syn.num_samples, syn.seed, **syn.generator_kwargs(), split="eval")
        source = "data.eval.synthetic"
    elif ev.jsonl is not None:
        samples = load_jsonl_dataset(ev.jsonl, ev.image_root, box_format=plan.box_format, verify_images=True)
        source = str(ev.jsonl)
    else:
        return [], 0, "data.eval has neither jsonl nor synthetic"
    return samples[: ev.max_samples], len(samples), source


@dataclass(frozen=True)
class EvalRun:
    report: EvalReport
    written: list[Path]
    images_per_s: float
    num_available: int  # samples in the split (max_samples may have cut it)


def run_eval(session: EvalSession, out_dir: Path, *, rank: int, world_size: int) -> EvalRun | None:
    """Evaluate `session.model` (or the rollout server of `session.server`) on `data.eval`; returns the run
    on rank 0 (None on other ranks). Call inside torchrun's process group when `world_size` > 1."""
    from stagectl.files import check_output_dir

    samples, num_available, source = load_eval_samples(session.eval)
    if not samples:
        raise ValueError(f"nothing to evaluate ({source}): give --data JSONL or set data.eval")
    ids = assign_ids(samples, source)
    created = rank == 0 and not out_dir.exists()
    if rank == 0:
        check_output_dir(out_dir, "--out")
    try:
        return _evaluate(session, out_dir, samples, num_available, source, ids, rank, world_size)
    except BaseException:
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()  # a failed start leaves no empty --out directory behind
        raise


def _evaluate(
    session: EvalSession,
    out_dir: Path,
    samples: list[DetectionSample],
    num_available: int,
    source: str,
    ids: Any,
    rank: int,
    world_size: int,
) -> EvalRun | None:
    from stagectl import dist
    from stagectl.detection.vocab import TokenVocab
    from stagectl.models.capability import chat_template_problem
    from stagectl.models.loading import load_bundle, load_tokenizer, resolve_checkpoint

    plan = session.eval
    given = session.model.name_or_path
    try:
        picked = resolve_checkpoint(given)  # as `stagectl export` reads it
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"--model / model.name_or_path: {exc}") from None
    if rank == 0 and picked.parent.parent == Path(given).expanduser():  # a run dir: RUN/checkpoint-N/model
        print(
            f"eval: {given} is a train-ab run; evaluating its newest checkpoint, {picked.parent.name} ({picked})",
            file=sys.stderr,
        )
    model_path = str(picked)
    spec = plan.sampling
    client = None
    if session.server is not None:
        from stagectl.inference.client import RolloutClient

        client = RolloutClient.for_servers(session.server)  # a missing token: the server's token_key
        client.wait_healthy(
            timeout_s=session.server.wait_healthy_s,
            on_wait=lambda line: say("eval", line),
            wait_key=session.server.wait_healthy_key,
        )
        tokenizer = load_tokenizer(model_path, add_coord_tokens=True)
        vocab = TokenVocab.from_tokenizer(tokenizer)
        generate = server_generate(client, samples, spec)
    else:
        problem = chat_template_problem(picked)  # rendered by the first generate, after the model loads
        if problem is not None:
            raise ValueError(f"--model / model.name_or_path: {problem}")
        bundle = load_bundle(model_path, torch_dtype=session.model.torch_dtype, add_coord_tokens=True)
        vocab = TokenVocab.from_tokenizer(bundle.tokenizer)
        generate = in_process_generate(bundle, samples, vocab, spec)
    score = plan.score
    chunks = shard_chunks(len(samples), plan.chunk_size, rank, world_size)
    progress = EvalProgress(  # rank 0 shows its own shard
        sum(map(len, chunks)), enabled=rank == 0, num_ranks=world_size, num_images=len(samples)
    )
    served = served_weights(client) if client is not None else None  # checked again at the end
    changed = None
    try:
        outcomes = judge_chunks(
            chunks,
            generate,
            samples,
            vocab,
            ids,
            duplicate_iou_threshold=plan.duplicate_iou_threshold,
            score=score,
            progress=progress,
        )
        if served is not None:
            changed = weights_changed_line(served, served_weights(client))
            if changed is not None:
                say("eval", f"warning: {changed}")
    finally:
        progress.close()
        if client is not None:
            client.close()
    images_per_s = progress.images_per_s
    gathered = dist.gather_objects((outcomes, images_per_s))
    if gathered is None:
        return None
    merged: list[ImageOutcome] = [o for part, _ in gathered for o in part]
    report = summarize(samples, merged, ids, score)
    images_per_s = sum(rate for _, rate in gathered)  # each rank's own rate, summed
    server_url = session.server.base_urls[0] if session.server is not None else None
    extra: dict[str, Any] = {
        "model": model_path if server_url is None else None,
        "server": server_url,
        "served_weights": served,  # each server's model and weight version at the start (None: no /version/)
        **({"served_weights_changed": changed} if changed is not None else {}),
        "data": source,
        "num_available": num_available,
        "world_size": world_size,
        "images_per_s": images_per_s,
        "sampling": {"temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k},
        "evaluator": "faster-coco-eval",
    }
    gallery = write_gallery(  # before write_report's metrics.json, whose presence says the eval is whole
        out_dir / GALLERY_DIR,
        samples,
        merged,
        num_images=plan.data.gallery_images,
        duplicate_iou_threshold=plan.duplicate_iou_threshold,
    )
    written = write_report(out_dir, report, extra) + gallery
    return EvalRun(report, written, images_per_s, num_available)
