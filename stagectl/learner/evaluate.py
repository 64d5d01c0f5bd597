"""Held-out evaluation: greedy rollouts on the eval split, strict parse, precision/recall/F1 at IoU 0.5,
invalid-rollout and duplicate rates, and per-image counters (so intervals can be bootstrapped over images).

Runs on rank 0 with the unwrapped policy (other ranks wait at a barrier) every `data.eval.every_steps`
optimizer steps and at the end; rows go to `{output_dir}/eval.jsonl`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from stagectl.config import StagectlConfig
from stagectl.config.rollout import DecodingConfig, RolloutMatchingConfig
from stagectl.config.stage2_ab import ChannelBConfig
from stagectl.data.jsonl import load_jsonl_dataset
from stagectl.data.sample import DetectionSample
from stagectl.data.synthetic import generate_synthetic
from stagectl.detection.parse import RolloutParse
from stagectl.detection.serialize import object_record
from stagectl.detection.stats import RolloutStats
from stagectl.learner.channel_b import score_rollout
from stagectl.learner.rollouts import HFRollouts
from stagectl.learner.segments import SampleEncoder
from stagectl.models.loading import ModelBundle

EVAL_FILE = "eval.jsonl"
EVAL_SAMPLES_FILE = "eval_samples.jsonl"
EVAL_IOU = 0.5
SHOWN_SAMPLES = 4  # rollouts per eval written out as text, to see what the model says
# per-image counters kept in each eval row, in this order
PER_IMAGE_FIELDS = ("n_gt", "n_valid", "n_matched", "n_invalid", "n_truncated", "n_dup")


def load_eval_samples(cfg: StagectlConfig) -> list[DetectionSample]:
    ev = cfg.data.eval if cfg.data is not None else None
    if ev is None:
        return []
    if ev.synthetic is not None:
        syn = ev.synthetic
        samples = generate_synthetic(syn.num_samples, syn.seed, **syn.generator_kwargs(), split="eval")
    elif ev.jsonl is not None:
        samples = load_jsonl_dataset(
            ev.jsonl, ev.image_root, box_format=cfg.data.box_format if cfg.data else "norm1000"
        )
    else:
        return []
    return samples[: ev.max_samples]


class Evaluator:
    def __init__(self, cfg: StagectlConfig, bundle: ModelBundle, encoder_vocab: Any) -> None:
        self.cfg = cfg
        self.samples = load_eval_samples(cfg)
        self.encoder = SampleEncoder(bundle=bundle, samples=self.samples, vocab=encoder_vocab)
        rm = cfg.custom.extra.rollout_matching
        # greedy decoding and the IoU 0.5 gate of the usual detection metric
        self.rm = RolloutMatchingConfig(
            max_new_tokens=rm.max_new_tokens,
            decoding=DecodingConfig(temperature=0.0),
            iou_gate=EVAL_IOU,
            fp_cost=rm.fp_cost,
            fn_cost=rm.fn_cost,
        )
        self.rollouts = HFRollouts(bundle.model, self.encoder, self.rm, chunk_size=8)
        self.path = Path(cfg.training.output_dir) / EVAL_FILE
        self.samples_path = Path(cfg.training.output_dir) / EVAL_SAMPLES_FILE
        if cfg.training.resume_from_checkpoint is None:
            self.path.unlink(missing_ok=True)  # a fresh run starts fresh eval logs
            self.samples_path.unlink(missing_ok=True)
        cb = cfg.stage2_ab.channel_b if cfg.stage2_ab is not None else ChannelBConfig()
        self.duplicate_iou_threshold = cb.duplicate_iou_threshold
        ev = cfg.data.eval if cfg.data is not None else None
        self.every_steps = ev.every_steps if ev is not None else 0

    @property
    def enabled(self) -> bool:
        return bool(self.samples)

    def due(self, step: int, max_steps: int) -> bool:
        return self.enabled and (step == max_steps or (self.every_steps > 0 and step % self.every_steps == 0))

    def run(self, step: int) -> dict[str, Any]:
        started = time.perf_counter()
        indices = list(range(len(self.samples)))
        generations = self.rollouts.rollout(indices, seed=0)
        stats = RolloutStats()
        shown: list[str] = []
        per_image: list[list[int]] = []
        for index, generation in zip(indices, generations, strict=True):
            parse, _, _, sample_stats = score_rollout(
                index, generation, self.encoder, self.rm, duplicate_iou_threshold=self.duplicate_iou_threshold
            )
            stats.add(sample_stats)
            per_image.append([getattr(sample_stats, name) for name in PER_IMAGE_FIELDS])
            if index < SHOWN_SAMPLES:
                shown.append(json.dumps(self._shown_row(step, index, generation.token_ids, parse)))
        row = {
            "step": step,
            **_metrics(stats),
            "eval_s": time.perf_counter() - started,
            "per_image_fields": list(PER_IMAGE_FIELDS),
            "per_image": per_image,  # for intervals: bootstrap over images (stagectl.report.intervals)
        }
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        with self.samples_path.open("a", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in shown))
        return row

    def _shown_row(self, step: int, index: int, token_ids: list[int], parse: RolloutParse) -> dict[str, Any]:
        """One rollout as text next to its ground truth, for `eval_samples.jsonl`."""
        tokenizer = self.encoder.bundle.tokenizer
        return {
            "step": step,
            "index": index,
            "rollout": tokenizer.decode(token_ids, skip_special_tokens=False),
            "parsed": [object_record(o) for o in parse.valid_objects],
            "gt": [object_record(o) for o in self.encoder.samples[index].objects],
        }


def _metrics(stats: RolloutStats) -> dict[str, float]:
    m = stats.metrics()
    return {
        "precision": m["rollout/precision"],
        "recall": m["rollout/recall"],
        "f1": m["rollout/f1"],
        "valid_json_rate": 1.0 - m["rollout/invalid_rate"] - m["rollout/parse_truncated_rate"],
        "invalid_rate": m["rollout/invalid_rate"] + m["rollout/parse_truncated_rate"],
        "dup_rate": m["rollout/dup_rate"],
        "n_dup": stats.n_dup,
        "n_samples": stats.n_samples,
        "n_gt": stats.n_gt,
        "n_pred": stats.n_valid,
        "n_matched": stats.n_matched,
        "n_dropped": stats.n_dropped,
    }
