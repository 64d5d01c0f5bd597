"""Running an evaluation (the impure shell around `evaluation.core`): rollouts from the model in this
process or from rollout servers, sharded over ranks, a progress bar, and the files of `stagectl eval`.

Images are cut into chunks of `EvalPlan.chunk_size` (`custom.extra.rollout_matching.decode_batch_size`)
in order; chunk c goes to rank c % world_size, so every chunk is generated in the same batch whatever the
number of ranks (greedy results do not depend on it), and image k is sampled with seed k when decoding
samples. Rank 0 gathers every rank's per-image outcomes and computes the metrics once.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stagectl.config.model_data import ScoreKind
from stagectl.config.sampling import SamplingSpec
from stagectl.data.sample import DetectionSample
from stagectl.detection.scores import DEFAULT_SCORE
from stagectl.detection.vocab import TokenVocab
from stagectl.evaluation.coco import CocoIds
from stagectl.evaluation.core import EvalReport, ImageOutcome, judge_image
from stagectl.files import atomic_write_text
from stagectl.models.generate import Generation
from stagectl.wire.protocol import RequestConfig

METRICS_FILE = "metrics.json"
PREDICTIONS_FILE = "predictions.coco.json"
# the predictions whose desc is no category (COCO results rows without one, with their desc): scored by the
# class-agnostic AP only
UNKNOWN_PREDICTIONS_FILE = "predictions.unknown_category.json"
GROUND_TRUTH_FILE = "ground_truth.coco.json"

Generate = Callable[[Sequence[int], int], list[Generation]]  # (sample indices, base seed) -> generations


def shard_chunks(num_samples: int, chunk_size: int, rank: int, world_size: int) -> list[list[int]]:
    """This rank's chunks of sample indices: chunk c (indices c*chunk_size ...) goes to rank c % world_size."""
    chunks = [list(range(s, min(s + chunk_size, num_samples))) for s in range(0, num_samples, chunk_size)]
    return chunks[rank::world_size]


def in_process_generate(
    bundle: Any, samples: Sequence[DetectionSample], vocab: TokenVocab, spec: SamplingSpec
) -> Generate:
    """Rollouts from `bundle.model` in this process (the learner's `generate_batch`), one batch per chunk,
    prompts encoded as the learner encodes them."""
    from stagectl.models.chat import encode_prompt
    from stagectl.models.generate import PromptInputs, generate_batch
    from stagectl.models.images import open_rgb

    pad = bundle.tokenizer.pad_token_id
    pad_token_id = int(pad) if pad is not None else 0  # as the learner's SampleEncoder pads

    def prompt(index: int) -> PromptInputs:
        images = [open_rgb(path) for path in samples[index].images]
        p = encode_prompt(bundle.tokenizer, bundle.require_image_processor(), images)
        return PromptInputs(p.input_ids, p.mm_token_type_ids, p.pixel_values, p.image_grid_thw)

    def generate(indices: Sequence[int], seed: int) -> list[Generation]:
        model = bundle.model
        was_training = model.training
        model.eval()
        try:
            return generate_batch(
                model,
                [prompt(i) for i in indices],
                spec,
                stop_token_ids=sorted(vocab.stop_ids),  # as the learner's own rollouts stop
                pad_token_id=pad_token_id,
                seed=seed,
            )
        finally:
            model.train(was_training)

    return generate


def server_generate(client: Any, samples: Sequence[DetectionSample], spec: SamplingSpec) -> Generate:
    """Rollouts from rollout servers: one `/infer/` call per chunk, request k seeded `seed + k`."""
    from stagectl.inference.requests import detection_infer_request, to_generation

    def generate(indices: Sequence[int], seed: int) -> list[Generation]:
        config = RequestConfig.from_sampling(spec, seed, return_details=True)
        responses = client.infer([detection_infer_request(samples[i]) for i in indices], config)
        return [to_generation(r) for r in responses]

    return generate


def served_weights(client: Any) -> list[dict[str, Any]] | None:
    """What each rollout server serves, by its `/version/`: model, weight version, engine. None for a server
    without `/version/` (a swift server: inference only) or one that no longer answers."""
    import httpx

    from stagectl.wire.errors import RolloutRequestError

    try:
        versions = client.versions()
    except (RolloutRequestError, httpx.HTTPError):
        return None
    return [
        {"url": url, "model": v.model, "version": v.version, "engine": v.engine}
        for url, v in zip(client.base_urls, versions, strict=True)
    ]


def weights_changed_line(before: list[dict[str, Any]], after: list[dict[str, Any]] | None) -> str | None:
    """The warning of an eval whose servers changed weights while it ran (a training run pushing to them):
    its numbers mix policies. None when every server ended on the weights it started with."""
    if after is None or before == after:
        return None
    changes = ", ".join(
        f"{b['url']} version {b['version']} -> {a['version']}"
        for b, a in zip(before, after, strict=True)
        if b != a
    )
    return (
        f"the servers' weights changed during the eval ({changes}): its images were answered by more than one "
        "policy, so these numbers describe no single checkpoint; evaluate a server no training run pushes to"
    )


class EvalProgress:
    """Images done and images/s: a rich bar on a terminal; otherwise (a job's log) a plain line with the time
    left at most every `log_every_s` seconds, and one for the last chunk. With several ranks it counts rank 0's
    shard, and says so (`num_ranks`, `num_images`: the whole eval's)."""

    def __init__(
        self,
        total: int,
        enabled: bool,
        log_every_s: float = 10.0,
        *,
        num_ranks: int = 1,
        num_images: int | None = None,
    ) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.total = total
        self.enabled = enabled
        self.done = 0
        self.started = time.perf_counter()
        self.log_every_s = log_every_s
        self._logged_at = self.started
        # "16/16 images" of a 32-image eval over two ranks read as a miscount
        self.shard = f" (rank 0's share of {num_images} on {num_ranks} ranks)" if num_ranks > 1 else ""
        console = Console(stderr=True)
        self._progress: Progress | None = None
        if enabled and console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]eval" + ("[/bold], rank 0's share" if num_ranks > 1 else "[/bold]")),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                console=console,
            )
            self._task = self._progress.add_task("images", total=total, rate="")
            self._progress.start()

    @property
    def images_per_s(self) -> float:
        return self.done / max(time.perf_counter() - self.started, 1e-9)

    def advance(self, num_images: int) -> None:
        self.done += num_images
        if not self.enabled:
            return
        rate = f"{self.images_per_s:.2f} images/s"
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done, rate=rate)
            return
        now = time.perf_counter()
        if now - self._logged_at < self.log_every_s and self.done < self.total:
            return
        self._logged_at = now
        left = (self.total - self.done) / max(self.images_per_s, 1e-9)
        eta = f", {left:.0f} s left" if self.done < self.total else ""
        print(f"eval: {self.done}/{self.total} images{self.shard}, {rate}{eta}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def judge_chunks(
    chunks: Sequence[Sequence[int]],
    generate: Generate,
    samples: Sequence[DetectionSample],
    vocab: TokenVocab,
    ids: CocoIds,
    *,
    duplicate_iou_threshold: float,
    score: ScoreKind = DEFAULT_SCORE,
    progress: EvalProgress | None = None,
) -> list[ImageOutcome]:
    """Generate and judge every chunk (image k seeded k), objects scored by `score`."""
    outcomes = []
    for chunk in chunks:
        generations = generate(chunk, chunk[0])
        for index, generation in zip(chunk, generations, strict=True):
            outcomes.append(
                judge_image(
                    index,
                    samples[index],
                    generation,
                    vocab,
                    ids,
                    duplicate_iou_threshold=duplicate_iou_threshold,
                    score=score,
                )
            )
        if progress is not None:
            progress.advance(len(chunk))
    return outcomes


def write_report(out_dir: Path, report: EvalReport, extra: dict[str, Any]) -> list[Path]:
    """`metrics.json`, `predictions.coco.json`, `predictions.unknown_category.json` and `ground_truth.coco.json`
    (each written whole: a file is either complete or absent). The ground truth is the one the metrics were computed on, COCO ids or not:
    the evaluated images only (`data.eval.max_samples`), boxes as the eval decodes them (from norm-1000 bins),
    crowd regions, COCO's `area` where the data kept it and else the box's. Scoring the predictions against
    COCO's own instances file instead gives other numbers (against all of val2017 when 64 images were
    evaluated: far lower ones)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    files: list[tuple[str, Any]] = [
        (PREDICTIONS_FILE, report.predictions),
        (UNKNOWN_PREDICTIONS_FILE, report.unknown_predictions),
        (GROUND_TRUTH_FILE, report.ground_truth),
    ]
    files.append((METRICS_FILE, {**report.metrics, **extra}))  # last: its presence means a complete eval
    for name, payload in files:
        path = out_dir / name
        atomic_write_text(path, json.dumps(payload, indent=1 if name == METRICS_FILE else None) + "\n")
        written.append(path)
    return written
