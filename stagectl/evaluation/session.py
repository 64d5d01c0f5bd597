"""`stagectl eval` end to end: check every input before any work (config, data, ids, output directory,
checkpoint or server), generate this rank's shard, merge on rank 0, write the files once at the end.
Bad input is a `ValueError` naming what and where; nothing is written unless the eval completes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagectl.config import StagectlConfig
from stagectl.config.stage2_ab import ChannelBConfig
from stagectl.data.jsonl import load_jsonl_dataset
from stagectl.data.sample import DetectionSample
from stagectl.data.synthetic import generate_synthetic
from stagectl.evaluation.coco import assign_ids
from stagectl.evaluation.core import EvalReport, ImageOutcome, summarize
from stagectl.evaluation.gallery import GALLERY_DIR, write_gallery
from stagectl.evaluation.run import (
    EvalProgress,
    eval_sampling,
    eval_score,
    in_process_generate,
    judge_chunks,
    server_generate,
    shard_chunks,
    write_report,
)


def load_eval_samples(cfg: StagectlConfig) -> tuple[list[DetectionSample], int, str]:
    """(the first `data.eval.max_samples` samples of the eval split, how many it has, what it is)."""
    ev = cfg.data.eval if cfg.data is not None else None
    if ev is None:
        return [], 0, "no data.eval"
    if ev.synthetic is not None:
        syn = ev.synthetic
        samples = generate_synthetic(syn.num_samples, syn.seed, **syn.generator_kwargs(), split="eval")
        source = "data.eval.synthetic"
    elif ev.jsonl is not None:
        box_format = cfg.data.box_format if cfg.data is not None else "norm1000"
        samples = load_jsonl_dataset(ev.jsonl, ev.image_root, box_format=box_format, verify_images=True)
        source = str(ev.jsonl)
    else:
        return [], 0, "data.eval has neither jsonl nor synthetic"
    return samples[: ev.max_samples], len(samples), source


def checkpoint_dir(path: str) -> str:
    """A train-ab checkpoint (`checkpoint-N/` holding `model/`) or a model directory, as a model path."""
    p = Path(path).expanduser()
    return str(p / "model") if (p / "model" / "config.json").is_file() else path


@dataclass(frozen=True)
class EvalRun:
    report: EvalReport
    written: list[Path]
    images_per_s: float
    num_available: int  # samples in the split (max_samples may have cut it)


def run_eval(
    cfg: StagectlConfig, out_dir: Path, *, server_url: str | None, rank: int, world_size: int
) -> EvalRun | None:
    """Evaluate `cfg.model.name_or_path` (or the servers at `server_url`) on `data.eval`; returns the run
    on rank 0 (None on other ranks). Call inside torchrun's process group when `world_size` > 1."""
    from stagectl.files import check_output_dir

    samples, num_available, source = load_eval_samples(cfg)
    if not samples:
        raise ValueError(f"nothing to evaluate ({source}): give --data JSONL or set data.eval")
    ids = assign_ids(samples, source)
    created = rank == 0 and not out_dir.exists()
    if rank == 0:
        check_output_dir(out_dir, "--out")
    try:
        return _evaluate(cfg, out_dir, samples, num_available, source, ids, server_url, rank, world_size)
    except BaseException:
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()  # a failed start leaves no empty --out directory behind
        raise


def _evaluate(
    cfg: StagectlConfig,
    out_dir: Path,
    samples: list[DetectionSample],
    num_available: int,
    source: str,
    ids: Any,
    server_url: str | None,
    rank: int,
    world_size: int,
) -> EvalRun | None:
    from stagectl import dist
    from stagectl.detection.vocab import TokenVocab
    from stagectl.models.loading import load_bundle, load_tokenizer, resolve_model_path

    model_path = checkpoint_dir(cfg.model.name_or_path)
    try:
        resolve_model_path(model_path)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"--model / model.name_or_path: {exc}") from None
    spec = eval_sampling(cfg)
    rm = cfg.custom.extra.rollout_matching
    cb = cfg.stage2_ab.channel_b if cfg.stage2_ab is not None else ChannelBConfig()
    client = None
    if server_url is not None:
        from stagectl.inference.client import RolloutClient
        from stagectl.wire.protocol import read_token

        token = read_token(
            rm.vllm.server.auth_token_env, "custom.extra.rollout_matching.vllm.server.auth_token_env"
        )
        client = RolloutClient([server_url], auth_token=token, infer_timeout_s=rm.vllm.server.infer_timeout_s)
        client.wait_healthy(timeout_s=rm.vllm.server.timeout_s)
        tokenizer = load_tokenizer(model_path, add_coord_tokens=True)
        vocab = TokenVocab.from_tokenizer(tokenizer)
        generate = server_generate(client, samples, spec)
    else:
        bundle = load_bundle(model_path, torch_dtype=cfg.model.torch_dtype, add_coord_tokens=True)
        vocab = TokenVocab.from_tokenizer(bundle.tokenizer)
        generate = in_process_generate(bundle, samples, vocab, spec)
    score = eval_score(cfg)
    chunks = shard_chunks(len(samples), rm.decode_batch_size, rank, world_size)
    progress = EvalProgress(sum(map(len, chunks)), enabled=rank == 0)  # rank 0 shows its own shard
    try:
        outcomes = judge_chunks(
            chunks,
            generate,
            samples,
            vocab,
            ids,
            duplicate_iou_threshold=cb.duplicate_iou_threshold,
            score=score,
            progress=progress,
        )
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
    extra: dict[str, Any] = {
        "model": model_path if server_url is None else None,
        "server": server_url,
        "data": source,
        "num_available": num_available,
        "world_size": world_size,
        "images_per_s": images_per_s,
        "sampling": {"temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k},
        "evaluator": "faster-coco-eval",
    }
    written = write_report(out_dir, report, ids, extra)
    num_gallery = cfg.data.eval.gallery_images if cfg.data is not None and cfg.data.eval is not None else 0
    written += write_gallery(
        out_dir / GALLERY_DIR,
        samples,
        merged,
        num_images=num_gallery,
        duplicate_iou_threshold=cb.duplicate_iou_threshold,
    )
    return EvalRun(report, written, images_per_s, num_available)
