"""The evaluation core on hand-made answers and logprobs: class-agnostic AP equals pycocotools' own
`useCats = 0` on the written files; desc accuracy, the desc-aware F1 and the desc histogram count what the
answers say; every score kind's AP and the constant-score AP are those of the same predictions re-ranked."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stagectl.config.model_data import ScoreKind
from stagectl.data.sample import DetectionSample, DetObject
from stagectl.detection.scores import SCORE_KINDS
from stagectl.evaluation.coco import assign_ids
from stagectl.evaluation.core import PER_IMAGE_FIELDS, EvalReport, judge_image, summarize
from stagectl.evaluation.run import (
    GROUND_TRUTH_FILE,
    PREDICTIONS_FILE,
    UNKNOWN_PREDICTIONS_FILE,
    write_report,
)
from stagectl.models.generate import Generation
from tests.unit.helpers import CHAR


@dataclass(frozen=True)
class Pred:
    desc: str
    bins: tuple[int, int, int, int]
    coord_lp: float = -0.1  # each coordinate token's logprob
    open_lp: float = -0.1  # the token that opens the object (vs closing the list)
    desc_lp: float = -0.1  # each desc token's logprob


def _generation(preds: list[Pred]) -> Generation:
    """The answer as the character tokenizer spells it, every token with its hand-set logprob."""
    pieces: list[tuple[str, float]] = [("{", 0.0)]
    for k, p in enumerate(preds, start=1):
        opening = (", " if k > 1 else "") + f'"object_{k}": {{"desc": "'
        pieces += [(opening[0], p.open_lp), (opening[1:], 0.0), (p.desc, p.desc_lp), ('", "bbox_2d": [', 0.0)]
        for j, b in enumerate(p.bins):
            pieces += [(", " if j else "", 0.0), ('"', 0.0), (f"<|coord_{b}|>", p.coord_lp), ('"', 0.0)]
        pieces.append(("]}", 0.0))
    pieces += [("}", 0.0), ("<|im_end|>", 0.0)]
    ids: list[int] = []
    logprobs: list[float] = []
    for text, lp in pieces:
        piece = CHAR.encode(text)
        ids += piece
        logprobs += [lp] * len(piece)
    return Generation(ids, "stop", logprobs)


CAT_1, DOG_1 = (100, 100, 300, 300), (500, 500, 800, 800)
DOG_2, CAT_3 = (0, 0, 400, 500), (200, 200, 700, 900)
GT = [[("cat", CAT_1), ("dog", DOG_1)], [("dog", DOG_2)], [("cat", CAT_3)]]
ANSWERS = [
    [
        Pred("cat", CAT_1),  # right box, right label
        # a false positive the coordinate score trusts most, but whose opening was unlikely: the model
        # nearly closed the list there (objectness ranks it last)
        Pred("dog", (10, 900, 60, 990), coord_lp=-0.001, open_lp=-4.0),
        Pred(
            "cat", DOG_1, coord_lp=-0.05, desc_lp=-2.0
        ),  # right box, wrong label: a sure box, an unsure label
    ],
    [Pred("dog", DOG_2)],
    [Pred("unicorn", (210, 200, 700, 880))],  # right box, a label that is no category: left out of COCO
]


def _evaluate(tmp_path: Path, score: ScoreKind = "coord") -> tuple[dict[str, Any], EvalReport]:
    samples = [
        DetectionSample([f"im{k}.png"], 100, 100, [DetObject(d, b) for d, b in objects])
        for k, objects in enumerate(GT)
    ]
    ids = assign_ids(samples, "test")
    outcomes = [
        judge_image(
            k, samples[k], _generation(ANSWERS[k]), CHAR.vocab, ids, duplicate_iou_threshold=0.9, score=score
        )
        for k in range(len(samples))
    ]
    report = summarize(samples, outcomes, ids, score)
    write_report(tmp_path, report, {})
    return json.loads((tmp_path / "metrics.json").read_text()), report


def _pycocotools(gt: Path, rows: list[dict[str, Any]], use_cats: int) -> list[float]:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(gt))
        evaluator = COCOeval(coco, coco.loadRes(rows), "bbox")
        evaluator.params.useCats = use_cats
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return [float(v) for v in evaluator.stats]


def test_class_agnostic_ap_is_pycocotools_use_cats_0_on_the_written_files(tmp_path: Path) -> None:
    """The class-agnostic AP scores the unicorn's box too (a right box with a label that is no category): as
    docs/evaluation.md says, pycocotools on `predictions.coco.json` plus `predictions.unknown_category.json`
    (each given any category id) gives it. Left out, image 3's cat was a box never found."""
    metrics, _ = _evaluate(tmp_path)
    gt = tmp_path / GROUND_TRUTH_FILE
    rows = json.loads((tmp_path / PREDICTIONS_FILE).read_text())
    unknown = json.loads((tmp_path / UNKNOWN_PREDICTIONS_FILE).read_text())
    assert [(r["image_id"], r["desc"]) for r in unknown] == [(3, "unicorn")]
    agnostic = _pycocotools(gt, rows + [{**r, "category_id": 1} for r in unknown], use_cats=0)
    aware = _pycocotools(gt, rows, use_cats=1)
    assert [metrics[k] for k in ("AP_agnostic", "AP50_agnostic", "AP75_agnostic", "AR100_agnostic")] == (
        pytest.approx([agnostic[0], agnostic[1], agnostic[2], agnostic[8]], abs=1e-12)
    )
    assert metrics["AR100_agnostic"] > _pycocotools(gt, rows, use_cats=0)[8]  # the unicorn's box is found
    assert [metrics[k] for k in ("AP", "AP50", "AP75", "AR100")] == pytest.approx(
        [aware[0], aware[1], aware[2], aware[8]], abs=1e-12
    )
    # the cat written on the dog's box costs class-aware AP only
    assert metrics["AP_agnostic"] > metrics["AP"] and metrics["AP50_agnostic"] > metrics["AP50"]


def test_desc_accuracy_desc_aware_f1_and_the_desc_histogram(tmp_path: Path) -> None:
    metrics, report = _evaluate(tmp_path)
    # 5 valid predictions, 4 GT, box-only matching pairs 4 of them; 2 of those pairs have the right desc
    assert (metrics["n_pred"], metrics["n_gt"], metrics["n_matched"], metrics["n_matched_desc"]) == (
        5,
        4,
        4,
        2,
    )
    assert metrics["desc_accuracy"] == pytest.approx(2 / 4)
    assert (metrics["precision_box"], metrics["recall_box"]) == pytest.approx((4 / 5, 4 / 4))
    assert metrics["f1_box"] == metrics["f1"] == pytest.approx(2 * 0.8 * 1.0 / 1.8)
    assert (metrics["precision_desc"], metrics["recall_desc"]) == pytest.approx((2 / 5, 2 / 4))
    assert metrics["f1_desc"] == pytest.approx(2 * 0.4 * 0.5 / 0.9)
    assert metrics["pred_desc_top"] == [["cat", 2], ["dog", 2], ["unicorn", 1]]
    assert metrics["pred_desc_top_share"] == pytest.approx(2 / 5) and metrics["num_pred_descs"] == 3
    assert metrics["gt_desc_top_share"] == pytest.approx(2 / 4) and metrics["num_gt_descs"] == 2
    # per-image counters carry the desc hits, so intervals can resample them
    column = PER_IMAGE_FIELDS.index("n_matched_desc")
    assert [row[column] for row in report.per_image] == [1, 1, 0]


@pytest.mark.parametrize("score", SCORE_KINDS)
def test_every_score_kinds_ap_and_the_constant_score_ap_rerank_the_same_predictions(
    tmp_path: Path, score: ScoreKind
) -> None:
    metrics, _ = _evaluate(tmp_path, score)
    gt = tmp_path / GROUND_TRUTH_FILE
    rows = json.loads((tmp_path / PREDICTIONS_FILE).read_text())
    assert metrics["score"] == score and set(metrics["AP_by_score"]) == {*SCORE_KINDS, "constant"}
    assert metrics["AP_by_score"][score] == metrics["AP"]
    assert metrics["AP_constant_score"] == metrics["AP_by_score"]["constant"]
    constant = [{**row, "score": 1.0} for row in rows]
    assert metrics["AP_constant_score"] == pytest.approx(_pycocotools(gt, constant, use_cats=1)[0], abs=1e-12)
    # the written scores are the chosen kind's (image 1: the false positive is row 2)
    first_image = [r["score"] for r in rows if r["image_id"] == 1]
    if score == "coord":
        assert first_image[1] > first_image[0]  # the surest box is the false positive
    if score == "objectness":
        assert first_image[1] < first_image[0]  # the unlikely opening ranks it last


def test_objectness_ranks_the_late_false_positive_last_and_beats_the_coordinate_score(tmp_path: Path) -> None:
    metrics, _ = _evaluate(tmp_path)
    by_score = metrics["AP_by_score"]
    assert by_score["objectness"] > by_score["coord"]  # the coordinate score puts the false positive first
    assert by_score["coord_desc"] > by_score["coord"]  # the unsure label drags the wrong-label cat down


@pytest.mark.parametrize(("bins", "matched"), [((100, 100, 300, 240), 1), ((100, 100, 300, 180), 0)])
def test_the_metrics_match_at_the_eval_iou_gate(bins: tuple[int, int, int, int], matched: int) -> None:
    """IoU 0.7 with the GT box is a match; IoU 0.4 (over training's default gate of 0.3, under the eval's
    0.5) is a false positive and a miss."""
    sample = DetectionSample(["im.png"], 100, 100, [DetObject("cat", CAT_1)])
    ids = assign_ids([sample], "test")
    outcome = judge_image(
        0, sample, _generation([Pred("cat", bins)]), CHAR.vocab, ids, duplicate_iou_threshold=0.9
    )
    assert (outcome.stats.n_matched, outcome.stats.n_fp, outcome.stats.n_fn) == (
        matched,
        1 - matched,
        1 - matched,
    )


# The answers of the user walkthrough's 30-step run: garbage that stops on a syntax error (it was counted
# neither invalid nor truncated, so valid_json_rate read 1.0), one cut off by the token limit, one with no
# `{` at all, and one complete answer whose only entry is dropped (valid JSON all the same).
GARBAGE = '{"object_1": {"desc": "bbox_2d": "bbox_2d": "<|coord_378|>", "object_2": {"desc": "'
CUT_OFF = '{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_1|>", "<|coo'
NO_BRACE = "cat at the top left<|im_end|>"
CLOSED_DROPPED = '{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_1|>"]}}<|im_end|>'


def _rates(answers: list[str]) -> dict[str, Any]:
    samples = [
        DetectionSample([f"im{k}.png"], 100, 100, [DetObject("cat", CAT_1)]) for k in range(len(answers))
    ]
    ids = assign_ids(samples, "test")
    outcomes = [
        judge_image(
            k,
            samples[k],
            Generation(CHAR.encode(text), "length"),
            CHAR.vocab,
            ids,
            duplicate_iou_threshold=0.9,
        )
        for k, text in enumerate(answers)
    ]
    return summarize(samples, outcomes, ids).metrics


@pytest.mark.parametrize(
    ("answers", "valid_json", "truncated"),
    [
        ([GARBAGE], 0.0, 0.0),
        ([GARBAGE, CUT_OFF, NO_BRACE, CLOSED_DROPPED], 0.25, 0.25),
        ([CLOSED_DROPPED, ""], 0.5, 0.0),  # an empty answer is no JSON object
    ],
)
def test_valid_json_rate_counts_only_answers_that_closed_as_one_json_object(
    answers: list[str], valid_json: float, truncated: float
) -> None:
    metrics = _rates(answers)
    assert metrics["valid_json_rate"] == pytest.approx(valid_json)
    assert metrics["invalid_rate"] == pytest.approx(1.0 - valid_json)
    assert metrics["truncated_rate"] == pytest.approx(truncated)


def test_a_prediction_on_a_crowd_region_is_ignored_as_cocoeval_ignores_it(tmp_path: Path) -> None:
    """COCO's `iscrowd: 1` regions (a sample's `crowd`, as `stagectl convert coco` keeps them): a prediction
    on one is neither a hit nor a false positive, as in the official evaluation. Dropping the regions made the
    surest prediction here (on the crowd) a false positive ranked first: AP 0.75 (person 0.5, dog 1)."""
    person, crowd = (100, 100, 300, 300), (500, 500, 900, 900)
    samples = [
        DetectionSample(
            ["im0.png"],
            100,
            100,
            [DetObject("person", person, category_id=1)],
            image_id=42,
            crowd=[DetObject("person", crowd, category_id=1)],
        ),
        DetectionSample(["im1.png"], 100, 100, [DetObject("dog", DOG_2, category_id=18)], image_id=7),
    ]
    answers = [
        [Pred("person", crowd, coord_lp=-0.001), Pred("person", person, coord_lp=-0.5)],
        [Pred("dog", DOG_2)],
    ]
    ids = assign_ids(samples, "test")
    outcomes = [
        judge_image(k, samples[k], _generation(answers[k]), CHAR.vocab, ids, duplicate_iou_threshold=0.9)
        for k in range(len(samples))
    ]
    report = summarize(samples, outcomes, ids, "coord")
    crowd_rows = [a for a in report.ground_truth["annotations"] if a["iscrowd"]]
    assert [(a["image_id"], a["category_id"]) for a in crowd_rows] == [(42, 1)]
    assert report.metrics["AP"] == pytest.approx(1.0) and report.metrics["AP_agnostic"] == pytest.approx(1.0)
    assert report.metrics["AP_by_score"]["constant"] == pytest.approx(1.0)
    # COCO ids came with the data, and the ground truth the metrics used is written all the same: pycocotools
    # on the two written files gives the eval's numbers (COCO's instances file would not: other images)
    write_report(tmp_path, report, {})
    rows = json.loads((tmp_path / PREDICTIONS_FILE).read_text())
    official = _pycocotools(tmp_path / GROUND_TRUTH_FILE, rows, use_cats=1)
    assert [report.metrics[k] for k in ("AP", "AP50", "AR100")] == pytest.approx(
        [official[0], official[1], official[8]], abs=1e-12
    )
    # a crowd region is no object to find: the box-only counts see the two objects only
    assert report.metrics["n_gt"] == 2 and report.metrics["n_pred"] == 3 and report.metrics["n_matched"] == 2


def test_an_objects_coco_area_decides_its_size_bucket_as_in_cocoeval(tmp_path: Path) -> None:
    """COCO's `area` is the mask's: a thin diagonal object with a 49x49 px box (medium by box area) has a
    small mask. With the area kept (`stagectl convert coco`), APs/APm bucket it as the official evaluation
    does; the box area put it under APm."""
    box = (0, 0, 500, 500)  # ~49.5 px square on a 100 px image: box area ~2450 > 32**2
    whole = (0, 0, 999, 999)  # the whole image, no area given: large by its box (99**2 > 96**2)
    samples = [
        DetectionSample(
            ["im0.png"], 100, 100, [DetObject("pole", box, category_id=3, area=600.0)], image_id=1
        ),
        DetectionSample(["im1.png"], 100, 100, [DetObject("pole", whole, category_id=3)], image_id=2),
    ]
    ids = assign_ids(samples, "test")
    answers = [[Pred("pole", box)], [Pred("pole", whole)]]
    outcomes = [
        judge_image(k, samples[k], _generation(answers[k]), CHAR.vocab, ids, duplicate_iou_threshold=0.9)
        for k in range(len(samples))
    ]
    report = summarize(samples, outcomes, ids, "coord")
    areas = [a["area"] for a in report.ground_truth["annotations"]]
    assert areas == [600.0, pytest.approx(99.0**2)]  # the second has no area: its box's
    assert report.metrics["APs"] == pytest.approx(1.0)  # the pole's mask is small
    assert report.metrics["APm"] == -1.0  # no medium object at all
    assert report.metrics["APl"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([{"image_id": 5}, "", "", {"image_id": 5}], "line 4 repeats image_id 5 of line 1"),
        ([{"image_id": 5}, "", {}], "line 3 has no image_id while other lines have one"),
        ([{"image_id": 5}, "", {"image_id": 6, "category_id": None}], "line 3 has no category_id"),
        (
            [{"image_id": 5}, "", {"image_id": 6, "category_id": 4}],
            "line 3: desc 'cat' has category_id 4 here",
        ),
    ],
)
def test_coco_id_errors_name_the_file_line_past_blank_lines(
    tmp_path: Path, lines: list[Any], expected: str
) -> None:
    """They named the sample's place instead (`line 2 repeats image_id 5 of line 1` for file lines 4 and 1)."""
    from stagectl.data.jsonl import load_jsonl_dataset

    def line(change: Any) -> str:
        if not change:
            return (
                ""
                if change == ""
                else json.dumps({"images": ["a.png"], "width": 8, "height": 8, "objects": []})
            )
        obj = {"desc": change.get("desc", "cat"), "bbox_2d": [1, 1, 5, 5]}
        if change.get("category_id", 3) is not None:
            obj["category_id"] = change.get("category_id", 3)
        record = {
            "images": ["a.png"],
            "width": 8,
            "height": 8,
            "objects": [obj],
            "image_id": change["image_id"],
        }
        return json.dumps(record)

    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(line(change) for change in lines) + "\n")
    (tmp_path / "a.png").write_bytes(b"not decoded")
    samples = load_jsonl_dataset(path, box_format="pixel")
    with pytest.raises(ValueError, match=expected):
        assign_ids(samples, str(path))
