"""train-ab's held-out evaluation: the same code as `stagectl eval` (`stagectl.evaluation`) run on the
policy in this process: rollouts (`data.eval.decoding`, greedy by default) -> strict parse -> per-object
scores -> COCO bbox AP/AR (class-aware and class-agnostic), box-only and desc-aware precision/recall/F1
at IoU 0.5, desc accuracy on matched pairs, the predicted-desc histogram, invalid-rollout and duplicate
rates, and per-image counters (so intervals can be bootstrapped over images).

Runs on rank 0 with the unwrapped policy (other ranks wait at a barrier) every `data.eval.every_steps`
optimizer steps and at the end; rows go to `{output_dir}/eval.jsonl`, each eval's COCO results rows (the
scored predictions) to `eval_predictions.jsonl` and the evaluated images as a COCO instances file to
`eval_gt.coco.json` (so AP can be bootstrapped over images and seeds: `stagectl.report.ap_intervals`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from stagectl.config.plan import EvalPlan
from stagectl.config.sampling import SamplingSpec
from stagectl.config.training import TrainingConfig
from stagectl.console import say
from stagectl.detection.scores import DEFAULT_SCORE
from stagectl.detection.serialize import object_record
from stagectl.detection.vocab import TokenVocab
from stagectl.evaluation.coco import assign_ids
from stagectl.evaluation.core import PER_IMAGE_FIELDS, ImageOutcome, summarize
from stagectl.evaluation.run import in_process_generate, judge_chunks, shard_chunks
from stagectl.evaluation.session import load_eval_samples
from stagectl.files import atomic_write_text
from stagectl.learner.metrics import keep_rows_before
from stagectl.models.loading import ModelBundle

EVAL_FILE = "eval.jsonl"
EVAL_SAMPLES_FILE = "eval_samples.jsonl"
EVAL_PREDICTIONS_FILE = "eval_predictions.jsonl"
EVAL_GT_FILE = "eval_gt.coco.json"
# = report.ap_intervals.GT_BEFORE: the evaluated images of the evals before `step`, when the set changed
EVAL_GT_BEFORE = "eval_gt.before-step-{step}.coco.json"
# also in metrics rows, as eval/<name> (box vs label: class-agnostic AP, desc accuracy, the desc-aware F1)
EVAL_LOGGED = (
    "AP",
    "AP50",
    "AP75",
    "f1",
    "precision",
    "recall",
    "AP_agnostic",
    "AP_constant_score",
    "f1_desc",
    "desc_accuracy",
    "pred_desc_top_share",
)
SHOWN_SAMPLES = 4  # rollouts per eval written out as text, to see what the model says


class Evaluator:
    def __init__(
        self,
        plan: EvalPlan | None,
        training: TrainingConfig,
        bundle: ModelBundle,
        encoder_vocab: TokenVocab,
        *,
        resume_step: int = 0,
    ) -> None:
        """`plan`: the run's held-out eval (None without `data.eval`: then it never generates); `training`:
        where the eval files go (`output_dir`) and whether this start continues a run."""
        # a resumed run replaces the rows of evals after its checkpoint (they are re-run), at its first eval
        self._replace_after: int | None = resume_step if resume_step else None
        self.bundle = bundle
        self.vocab = encoder_vocab
        self.samples, _, source = load_eval_samples(plan)
        self.ids = assign_ids(self.samples, source)  # refuses mixed COCO ids before training starts
        spec = plan.sampling if plan is not None else SamplingSpec(max_new_tokens=1, temperature=0.0)
        self.generate = in_process_generate(bundle, self.samples, encoder_vocab, spec)
        self.score = plan.score if plan is not None else DEFAULT_SCORE
        self.chunk_size = plan.chunk_size if plan is not None else 1
        out = Path(training.output_dir)
        self.path = out / EVAL_FILE
        self.samples_path = out / EVAL_SAMPLES_FILE
        self.predictions_path = out / EVAL_PREDICTIONS_FILE
        self.gt_path = out / EVAL_GT_FILE
        self._gt_written: str | None = None  # what this process last wrote or found in `gt_path`
        if training.resume_from_checkpoint is None:
            # a fresh run starts fresh eval logs
            for path in (self.path, self.samples_path, self.predictions_path):
                path.unlink(missing_ok=True)
        self.duplicate_iou_threshold = plan.duplicate_iou_threshold if plan is not None else 0.7
        self.every_steps = plan.data.every_steps if plan is not None else 0

    @property
    def enabled(self) -> bool:
        return bool(self.samples)

    def due(self, step: int, max_steps: int) -> bool:
        return self.enabled and (step == max_steps or (self.every_steps > 0 and step % self.every_steps == 0))

    def run(self, step: int) -> dict[str, Any]:
        started = time.perf_counter()
        outcomes = judge_chunks(
            shard_chunks(len(self.samples), self.chunk_size, rank=0, world_size=1),
            self.generate,
            self.samples,
            self.vocab,
            self.ids,
            duplicate_iou_threshold=self.duplicate_iou_threshold,
            score=self.score,
        )
        report = summarize(self.samples, outcomes, self.ids, self.score)
        if self._replace_after is not None:
            for path in (self.path, self.samples_path, self.predictions_path):
                if path.exists():
                    keep_rows_before(path, self._replace_after + 1)  # eval steps count steps done
            self._replace_after = None
        row = {
            "step": step,
            **report.metrics,
            "eval_s": time.perf_counter() - started,
            "per_image_fields": list(PER_IMAGE_FIELDS),
            "per_image": report.per_image,  # for intervals: bootstrap over images (stagectl.report.intervals)
        }
        self._write_ground_truth(report.ground_truth, step)
        with self.predictions_path.open("a", encoding="utf-8") as handle:
            handle.write(
                json.dumps(
                    {
                        "step": step,
                        "score": self.score,
                        "predictions": report.predictions,
                        "unknown_category": report.unknown_predictions,  # the class-agnostic AP's too
                    }
                )
                + "\n"
            )
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        shown = [json.dumps(self._shown_row(step, o)) for o in outcomes if o.index < SHOWN_SAMPLES]
        with self.samples_path.open("a", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in shown))
        return row

    def _write_ground_truth(self, gt: dict[str, Any], step: int) -> None:
        """`eval_gt.coco.json`: the images this eval scored. A run whose held-out set changed (a resume with
        another `data.eval`) keeps the earlier evals' as `eval_gt.before-step-{step}.coco.json` and says so
        (it kept the first set's, and their AP was re-scored against the wrong images)."""
        text = json.dumps(gt)
        if text == self._gt_written:  # the set of this run's last eval: the file holds it
            return
        if self.gt_path.is_file():
            if self.gt_path.read_text(encoding="utf-8") == text:  # read once a start: a resume's first eval
                self._gt_written = text
                return
            kept = self.gt_path.with_name(EVAL_GT_BEFORE.format(step=step))
            os.replace(self.gt_path, kept)
            say(
                "train-ab",
                f"warning: the held-out set differs from the one the run's earlier evals scored ({kept.name} "
                f"now); evals from step {step} on are on the new one: compare AP within one set",
            )
        atomic_write_text(self.gt_path, text)
        self._gt_written = text

    def _shown_row(self, step: int, outcome: ImageOutcome) -> dict[str, Any]:
        """One rollout as text next to its ground truth, for `eval_samples.jsonl`."""
        return {
            "step": step,
            "index": outcome.index,
            "rollout": self.bundle.tokenizer.decode(outcome.token_ids, skip_special_tokens=False),
            "parsed": outcome.parsed,  # desc, bbox_2d and the object's score
            "gt": [object_record(o) for o in self.samples[outcome.index].objects],
        }
