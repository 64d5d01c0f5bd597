"""`stagectl eval` against a scripted engine behind the real rollout server (127.0.0.1, in a thread): the
model's answers and per-token logprobs are hand-built, so the metrics are known. AP recomputed from the
written files with faster-coco-eval and with pycocotools equals metrics.json; object scores follow the
engine's logprobs (flip them and the ranking, hence AP, flips); unknown categories are counted; bad input
is one clear error and writes nothing; `--nproc 2` (torchrun, one subprocess run) gives one rank's
metrics; a checkpoint in process writes COCO files pycocotools reads."""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from stagectl.cli.app import app
from stagectl.config import load_config
from stagectl.config.plan_eval import eval_session
from stagectl.engines.interface import EngineRequest, EngineResult, TensorSpec
from stagectl.evaluation.session import run_eval
from stagectl.models.loading import load_tokenizer
from stagectl.report.markdown import fmt
from stagectl.report.write import write_reports
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from tests.integration.helpers import run_cli

MODEL = "builtin:tiny-qwen2.5-vl"
TOKEN = "eval-token"
TOKEN_ENV = "STAGECTL_TEST_EVAL_TOKEN"
SERVER = "custom.extra.rollout_matching.vllm.server"
HEIGHT = 56
OTHER_LOGPROB = -0.5  # every token that is not a coordinate

# width of the image -> ground truth; the answer of the engine is built from `answers` below
GT: dict[int, list[tuple[str, list[int]]]] = {
    56: [("cat", [100, 100, 300, 300]), ("cat", [500, 500, 800, 800])],
    84: [("dog", [0, 0, 400, 500]), ("cat", [600, 100, 900, 400])],
    112: [("dog", [200, 200, 700, 900])],
}


@dataclass
class Pred:
    desc: str
    bins: list[int]
    coord_logprobs: list[float]  # of its four coordinate tokens


def answers(fp_logprob: float) -> dict[int, list[Pred]]:
    return {
        # two hits and one false positive in between, whose confidence the test sets
        56: [
            Pred("cat", [100, 100, 300, 300], [-0.1] * 4),
            Pred("cat", [10, 900, 60, 990], [fp_logprob] * 4),
            Pred("cat", [500, 500, 800, 800], [-0.2, -0.2, -0.1, -0.1]),
        ],
        84: [Pred("dog", [0, 0, 400, 500], [-0.3] * 4), Pred("unicorn", [600, 100, 900, 400], [-0.1] * 4)],
        112: [Pred("dog", [210, 200, 700, 880], [-0.05, -0.1, -0.15, -0.2])],
    }


class ScriptedEngine:
    """Answers each image (known by its width) with hand-built detections and logprobs."""

    name = "scripted"
    model_name = "scripted"
    version = 0
    max_model_len = 32768  # context the server's bounds check requests against
    max_batch_size = None  # answers each request alone

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.fp_logprob = -3.0

    def _answer(self, preds: Sequence[Pred]) -> tuple[list[int], list[float]]:
        ids: list[int] = []
        logprobs: list[float] = []

        def add(text: str, logprob: float = OTHER_LOGPROB) -> None:
            piece = self.tokenizer.encode(text, add_special_tokens=False)
            ids.extend(piece)
            logprobs.extend([logprob] * len(piece))

        add("{")
        for k, pred in enumerate(preds, start=1):
            add(("" if k == 1 else ", ") + f'"object_{k}": {{"desc": "{pred.desc}", "bbox_2d": [')
            for j, (b, lp) in enumerate(zip(pred.bins, pred.coord_logprobs, strict=True)):
                add(", " if j else "")
                add('"')
                add(f"<|coord_{b}|>", lp)
                add('"')
            add("]}")
        add("}")
        return [*ids, self.end_of_turn], [*logprobs, OTHER_LOGPROB]

    def generate(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        results = []
        for request in requests:
            ids, logprobs = self._answer(answers(self.fp_logprob)[request.images[0].width])
            assert request.params.logprobs and request.params.temperature == 0
            pieces = [self.tokenizer.decode([i]).encode() for i in ids]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            results.append(EngineResult([1, 2, 3], ids, text, "stop", 0, logprobs, pieces))
        return results

    def weight_specs(self) -> dict[str, TensorSpec]:
        return {}

    def apply_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError

    def batch_sizes(self) -> dict[int, int]:
        return {}

    def close(self) -> None:
        pass


@dataclass
class Served:
    url: str
    engine: ScriptedEngine
    jsonl: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("eval_data")
    lines = []
    for width, objects in GT.items():
        Image.new("RGB", (width, HEIGHT), (90, 90, 90)).save(root / f"w{width}.png")
        lines.append(
            {
                "images": [f"w{width}.png"],
                "width": width,
                "height": HEIGHT,
                "objects": [{"desc": d, "bbox_2d": b} for d, b in objects],
            }
        )
    jsonl = root / "eval.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    engine = ScriptedEngine(load_tokenizer(MODEL, add_coord_tokens=True))
    settings = ServerSettings(image_roots=[root], auth_token=TOKEN)
    server = ThreadedServer(build_app(RolloutService(engine, settings))).start()  # type: ignore[arg-type]
    yield Served(server.url, engine, jsonl)
    server.stop()


def _sets(served: Served) -> list[str]:
    return [
        f"data.train_jsonl={served.jsonl}",
        f"data.eval.jsonl={served.jsonl}",
        f"custom.extra.rollout_matching.vllm.server.auth_token_env={TOKEN_ENV}",
        "custom.extra.rollout_matching.decode_batch_size=2",
        "stage2_ab.schedule.b_ratio=0.0",
        "data.eval.score=coord",  # the scripted answers set the coordinate tokens' logprobs; pin that score
    ]


def _evaluate(served: Served, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    run = run_eval(eval_session(load_config(None, _sets(served)), served.url), out, rank=0, world_size=1)
    assert run is not None
    return json.loads((out / "metrics.json").read_text())


def _faster(gt: Path, predictions: Path) -> list[float]:
    from faster_coco_eval import COCO, COCOeval_faster

    coco = COCO(str(gt))
    evaluator = COCOeval_faster(coco, coco.loadRes(str(predictions)), "bbox")
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    return [float(v) for v in evaluator.stats[:12]]


def _pycocotools(gt: Path, predictions: Path, use_cats: int = 1) -> list[float]:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(gt))
        evaluator = COCOeval(coco, coco.loadRes(str(predictions)), "bbox")
        evaluator.params.useCats = use_cats
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return [float(v) for v in evaluator.stats]


NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


def test_metrics_recomputed_from_the_written_files_agree(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served.engine.fp_logprob = -3.0
    metrics = _evaluate(served, tmp_path, monkeypatch)
    gt, predictions = tmp_path / "ground_truth.coco.json", tmp_path / "predictions.coco.json"
    ours = [metrics[name] for name in NAMES]
    assert _faster(gt, predictions) == pytest.approx(ours, abs=1e-12)
    assert _pycocotools(gt, predictions) == pytest.approx(ours, abs=1e-12)  # the reference agrees
    # boxes only: the reference's own useCats = 0, on the predictions of both files (the unicorn's box, whose
    # desc is no category, given the first category's id, as stagectl does)
    unknown = json.loads((tmp_path / "predictions.unknown_category.json").read_text())
    assert [r["desc"] for r in unknown] == ["unicorn"]
    both = tmp_path / "both.json"
    both.write_text(
        json.dumps(json.loads(predictions.read_text()) + [{**r, "category_id": 1} for r in unknown])
    )
    agnostic = _pycocotools(gt, both, use_cats=0)
    assert [metrics[f"{k}_agnostic"] for k in ("AP", "AP50", "AP75")] == pytest.approx(
        agnostic[:3], abs=1e-12
    )
    # the unicorn's box is right, its label is not (no category): desc accuracy 4 of the 5 matched pairs
    assert (metrics["n_matched_desc"], metrics["desc_accuracy"]) == (4, pytest.approx(4 / 5))
    # 6 valid predictions, 5 GT; the unicorn matches a cat box (class-agnostic F1) but is no COCO category
    assert (metrics["n_pred"], metrics["n_gt"], metrics["n_matched"]) == (6, 5, 5)
    assert metrics["f1"] == pytest.approx(2 * (5 / 6) * 1.0 / (5 / 6 + 1.0))
    assert metrics["n_unknown_category"] == 1 and metrics["unknown_category_rate"] == pytest.approx(1 / 6)
    rows = json.loads(predictions.read_text())
    assert len(rows) == 5 and {r["category_id"] for r in rows} == {1, 2}  # cat=1, dog=2 (sorted desc)
    assert set(metrics["per_class_ap"]) == {"cat", "dog"}
    assert metrics["invalid_rate"] == 0 and metrics["n_images"] == 3
    # `stagectl report` on the eval dir: the metrics, the per-class table and the precision-recall curve
    (written,) = write_reports(tmp_path)
    text = written.report.read_text()
    assert (
        f"| AP50 | {fmt(metrics['AP50'])} |" in text
        and f"| cat | {fmt(metrics['per_class_ap']['cat'])} |" in text
    )
    assert "](report/pr_curve.png)" in text and (tmp_path / "report" / "pr_curve.png").stat().st_size > 1000
    # the gallery (data.eval.gallery_images), shown on report.html: only the image with a false positive
    # (the unicorn's box matches: the gallery matches boxes as the metrics do)
    gallery = json.loads((tmp_path / "gallery" / "gallery.json").read_text())["images"]
    assert [e["index"] for e in gallery] == [0] and written.html is not None
    assert all(f'src="gallery/{e["file"]}"' in written.html.read_text() for e in gallery)


def test_scores_are_the_engines_coordinate_logprobs_and_rank_the_objects(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served.engine.fp_logprob = -3.0  # the false positive is the least confident object
    low = _evaluate(served, tmp_path / "low", monkeypatch)
    rows = json.loads((tmp_path / "low" / "predictions.coco.json").read_text())
    image_56 = [r["score"] for r in rows if r["image_id"] == 1]
    assert image_56 == pytest.approx([math.exp(-0.1), math.exp(-3.0), math.exp(-0.15)])
    served.engine.fp_logprob = -0.01  # now it is the most confident one
    high = _evaluate(served, tmp_path / "high", monkeypatch)
    # with the false positive ranked last, every cat is found before any mistake: cat AP50 is 1
    assert low["per_class_ap"]["cat"] > high["per_class_ap"]["cat"]
    assert low["AP50"] > high["AP50"]
    assert (low["f1"], low["n_matched"]) == (high["f1"], high["n_matched"])  # F1 ignores scores


def test_bad_input_is_one_error_and_writes_nothing(served: Served, tmp_path: Path) -> None:
    mixed = tmp_path / "mixed.jsonl"
    lines = served.jsonl.read_text().splitlines()
    first = json.loads(lines[0])
    first["image_id"] = 7
    mixed.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text(lines[0] + "\n" + '{"images": ["w56.png"], "width": 56}\n')
    config = tmp_path / "cfg.yaml"
    config.write_text(f"data:\n  train_jsonl: {served.jsonl}\nstage2_ab:\n  schedule: {{b_ratio: 0.0}}\n")
    cases = [
        (["--data", str(tmp_path / "missing.jsonl")], "missing.jsonl: no such file"),
        (["--data", str(mixed)], "line 2 has no image_id while other lines have one"),
        (["--data", str(bad_line)], "bad.jsonl:2"),
        (["--data", str(served.jsonl), "--model", str(tmp_path / "nope")], "model directory not found"),
        (["--data", str(served.jsonl), "--set", "data.eval.decoding.temperature=-1"], "temperature"),
        (
            ["--data", str(served.jsonl), "--server", "http://127.0.0.1:9", "--set", f"{SERVER}.timeout_s=1"],
            "rollout servers not healthy after 1 s",
        ),
    ]
    runner = CliRunner()
    for k, (args, message) in enumerate(cases):
        out = tmp_path / f"out{k}"
        root = ["--set", f"data.eval.image_root={served.jsonl.parent}"]
        result = runner.invoke(app, ["eval", str(config), "--out", str(out), *root, *args])
        assert result.exit_code == 1, (args, result.output)
        assert message in result.output, (args, result.output)
        assert not out.exists(), (args, sorted(out.iterdir()))  # not even an empty directory


def test_an_eval_stopped_while_drawing_its_gallery_has_no_metrics_json(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gallery was drawn after metrics.json: an eval stopped (Ctrl-C, SIGKILL, a full disk) while it drew
    left a directory that reads as a finished eval (metrics.json; its Ctrl-C line: "after its results were
    written") with half a gallery. metrics.json is written last, so it says the eval is whole."""
    import stagectl.evaluation.gallery as gallery
    from stagectl.cli.evaluate import interrupted_line

    class HalfSaved:
        def save(self, path: Path) -> None:
            path.write_bytes(b"\x89PNG half")
            raise KeyboardInterrupt

    monkeypatch.setattr(gallery, "draw", lambda *args: HalfSaved())
    with pytest.raises(KeyboardInterrupt):
        _evaluate(served, tmp_path, monkeypatch)
    assert not (tmp_path / "metrics.json").exists()
    assert not (tmp_path / "gallery").exists()  # no half gallery either
    assert "nothing was written" in interrupted_line(tmp_path)


def test_two_ranks_give_one_ranks_metrics(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served.engine.fp_logprob = -0.7
    one = _evaluate(served, tmp_path / "one", monkeypatch)
    config = tmp_path / "cfg.yaml"
    config.write_text("{}\n")
    args = [a for s in _sets(served) for a in ("--set", s)]
    result = run_cli(
        "eval", str(config), "--server", served.url, "--nproc", "2", "--out", str(tmp_path / "two"), *args,
        timeout=300, env={TOKEN_ENV: TOKEN},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "AP=" in result.stdout and "images/s" in result.stdout
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["world_size"] == 2
    for key in (*NAMES, "f1", "precision", "recall", "per_class_ap", "pr_curve_iou50", "n_unknown_category"):
        assert two[key] == one[key], key
    assert (tmp_path / "two" / "predictions.coco.json").read_text() == (
        tmp_path / "one" / "predictions.coco.json"
    ).read_text()


def test_checkpoint_in_process_end_to_end(tmp_path: Path) -> None:
    """The real CLI on the tiny model (its own rollouts, in process): files, metrics and the throughput line."""
    from pycocotools.coco import COCO

    demo = run_cli(
        "demo-data", str(tmp_path / "demo"), "--num-samples", "2", "--num-eval-samples", "5", timeout=120
    )
    assert demo.returncode == 0, demo.stderr[-2000:]
    config = tmp_path / "cfg.yaml"
    config.write_text(
        f"data:\n  train_jsonl: {tmp_path / 'demo' / 'train.jsonl'}\nstage2_ab:\n  schedule: {{b_ratio: 0.0}}\n"
    )
    out = tmp_path / "out"
    result = run_cli(
        "eval", str(config), "--model", MODEL, "--data", str(tmp_path / "demo" / "eval.jsonl"), "--out", str(out),
        "--set", "custom.extra.rollout_matching.max_new_tokens=24", "--set", "data.eval.max_samples=4",
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "images/s" in result.stdout and "AP50=" in result.stdout
    assert "evaluated the first 4 of 5 samples" in result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n_images"] == 4 and metrics["num_available"] == 5 and metrics["server"] is None
    assert set(NAMES) <= set(metrics) and metrics["images_per_s"] > 0
    assert isinstance(json.loads((out / "predictions.coco.json").read_text()), list)
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(out / "ground_truth.coco.json"))
    assert len(gt.getImgIds()) == 4 and len(gt.getAnnIds()) == metrics["n_gt"]


def test_the_served_weights_are_recorded_and_a_change_during_the_eval_is_said(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """metrics.json names what the server served (its `/version/`: model, weight version, engine). A server
    a training run pushed to while the eval ran answered with more than one policy: the eval says so on the
    console, in metrics.json and in its report, instead of passing the mix off as one checkpoint's numbers."""
    import stagectl.evaluation.session as session

    metrics = _evaluate(served, tmp_path / "same", monkeypatch)
    (weights,) = metrics["served_weights"]
    assert weights["url"] == served.url and weights["version"] == 0 and weights["model"]
    assert "served_weights_changed" not in metrics

    real = session.served_weights
    calls: list[int] = []

    def pushed_to_meanwhile(client: Any) -> Any:
        found = real(client)
        calls.append(1)
        return found if len(calls) == 1 else [{**found[0], "version": 3}]

    monkeypatch.setattr(session, "served_weights", pushed_to_meanwhile)
    metrics = _evaluate(served, tmp_path / "changed", monkeypatch)
    changed = metrics["served_weights_changed"]
    assert changed.startswith(f"the servers' weights changed during the eval ({served.url} version 0 -> 3)")
    assert f"eval: warning: {changed}" in capsys.readouterr().err
    (written,) = write_reports(tmp_path / "changed")
    assert f"- {changed}." in written.report.read_text()
