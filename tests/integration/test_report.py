"""`stagectl report` as a subprocess on small generated run dirs (fake but realistic rows, no training):
report.md content, PNGs that are real images of a readable size, partial runs, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image

from stagectl.schedule import channel_for_step
from tests.integration.helpers import run_cli

ASYNC = "stage2_ab/async/"
TRAIN_AB_PLOTS = (
    "loss",
    "rollout",
    "eval",
    "pr_curve",
    "b_ratio",
    "async_queue",
    "async_drops",
    "timing",
    "phases",
    "optimizer",
)


def write_jsonl(path: Path, rows: list[dict[str, Any]], torn_tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn_tail, encoding="utf-8")


def train_ab_rows(num_steps: int, b_ratio: str, async_mode: bool, skips: set[int]) -> list[dict[str, Any]]:
    """Rows shaped like the learner's: loss terms, timings, rollout/* on B steps, stage2_ab/async/*."""
    rows = []
    num_b = 0
    for step in range(num_steps):
        wants_b = channel_for_step(step, b_ratio) == "B"
        kind = "B" if wants_b and step not in skips else "A"
        num_b += kind == "B"
        row: dict[str, Any] = {
            "step": step,
            "kind": kind,
            "policy_wants_b": wants_b,
            "lr": 1e-3,
            "loss": 9.0 - 0.1 * step,
            "loss/bbox_ciou": 1.4 - 0.005 * step,
            "loss/bbox_smoothl1": 0.2 - 0.001 * step,
            "loss/ce": 7.5 - 0.09 * step,
            "loss/coord_ce": 0.0,
            "grad_norm": 4.0,
            "optim/update_nonzero_frac": 0.9,
            "tokens": 1400 + 10 * (step % 5),
            "time/step_s": 0.4 if kind == "A" else 0.9,
            "time/rollout_s": 0.0,
            "time/wait_s": 0.01,
            "time/wait_packs_s": 0.01,
            "time/collate_s": 0.0 if async_mode or kind == "A" else 0.05,
            "time/forward_backward_s": 0.3 if kind == "A" else 0.5,
            "time/optimizer_s": 0.02,
            "time/fence_s": 0.01 if async_mode and step % 2 else 0.0,
            "time/weight_sync_s": 0.1 if step % 2 else 0.0,
            "packing/fill": 0.7,
            "packing/n_packs": 2,
            "packing/lower_bound": 2,
            "packing/n_segments": 8,
        }
        if kind == "B":
            f1 = min(1.0, 0.02 * step)
            row.update({"rollout/precision": f1, "rollout/recall": f1 / 2, "rollout/f1": f1})
            row.update(
                {"rollout/invalid_rate": 1.0 - f1, "rollout/parse_truncated_rate": 0.05, "rollout/n_valid": 3}
            )
        if async_mode:
            row.update(
                {
                    ASYNC + "policy_wants_b": int(wants_b),
                    ASYNC + "b_step_skipped_due_to_queue": int(step in skips),
                    ASYNC + "queue_depth": 2 + step % 3,
                    ASYNC + "ver_current": step,
                    ASYNC + "drop_stale_total": step // 10,
                    ASYNC + "drop_oldest_total": step // 20,
                    ASYNC + "b_ratio_realized": num_b / (step + 1),
                    ASYNC + "prefetch_success_total": 2 * step,
                    ASYNC + "prefetch_fail_total": 0,
                    ASYNC + "sync_total": step,
                    ASYNC + "sync_fail_total": 0,
                }
            )
            if kind == "B":
                row[ASYNC + "ver_lag"] = 1 + step % 2
        rows.append(row)
    return rows


def write_config(run_dir: Path, b_ratio: Any, mode: str, max_steps: int) -> None:
    config = {
        "training": {"max_steps": max_steps, "output_dir": str(run_dir)},
        "launch": {"nproc_per_node": 2 if mode == "async" else 1},
        "stage2_ab": {"schedule": {"b_ratio": b_ratio}, "channel_b": {"mode": mode}},
        "data": {"synthetic": {"num_samples": 16}},
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")


def assert_readable_png(path: Path) -> None:
    assert path.is_file(), path
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
        assert 800 <= width <= 2400 and 300 <= height <= 2400, (path.name, image.size)
        grey = image.convert("L")
        low, high = grey.getextrema()
        assert isinstance(low, int) and isinstance(high, int) and high - low > 100, (
            f"{path.name} looks blank"
        )  # text and lines on a white background


PR = {"recall": [k / 100 for k in range(101)], "precision": [1 - k / 200 for k in range(101)]}


def test_async_run_report(tmp_path: Path) -> None:
    run_dir = tmp_path / "async"
    rows = train_ab_rows(40, "1/3", async_mode=True, skips={2, 5})
    write_jsonl(run_dir / "metrics.jsonl", rows, torn_tail='{"step": 40, "kind": "A", "lo')
    write_config(run_dir, "1/3", "async", max_steps=40)
    (run_dir / "final_state.json").write_text("{}")
    samples, next_pos = [], {("A", 0): 0, ("A", 1): 0, ("B", 0): 0, ("B", 1): 0}
    for r in rows:  # 2 samples per rank and step; B ones 1 or 2 versions old
        for rank in (0, 1):
            for _ in range(2):
                key = (r["kind"], rank)
                line = {"step": r["step"], "channel": r["kind"], "rank": rank, "sample": next_pos[key] % 16}
                line["stream_pos"] = next_pos[key]
                next_pos[key] += 1
                if r["kind"] == "B":
                    line.update(gen_version=r["step"] - 1 - r["step"] % 2, train_version=r["step"])
                samples.append(line)
    write_jsonl(run_dir / "samples.jsonl", samples)
    write_jsonl(
        run_dir / "eval.jsonl",
        [
            {
                "step": s,
                "precision": 0.1,
                "recall": 0.1,
                "f1": f,
                "AP": ap,
                "AP50": 2 * ap,
                "pr_curve_iou50": PR,
            }
            for s, f, ap in ((20, 0.3, 0.05), (40, 0.25, 0.125))
        ],
    )

    result = run_cli("report", str(run_dir), timeout=120)
    assert result.returncode == 0, result.stderr
    # eval.png + pr_curve.png + the two samples.jsonl plots + phases.png
    assert f"report: wrote {run_dir / 'report.md'} and 12 plot(s)" in result.stdout

    text = (run_dir / "report.md").read_text()
    num_b = sum(r["kind"] == "B" for r in rows)
    assert num_b == 11  # 13 scheduled B steps in 40 at 1/3, two of them skipped
    assert (
        "| optimizer steps logged | 40 (steps 0–39; steps here count from 0 as `metrics.jsonl` does: the "
        "console's `step 1/N` is step 0) |"
    ) in text
    assert f"| Channel-A / Channel-B steps | {40 - num_b} / {num_b} |" in text
    assert f"| B ratio: realised / target | {num_b / 40:.4f} / 1/3 (0.3333) |" in text
    assert "| B steps wanted by the schedule | 13 |" in text
    assert "| skip-to-A steps (wanted B, trained A) | 2 (step 2, 5) |" in text
    assert "| dropped packs: stale / oldest | 3 / 1 |" in text
    assert "| ver_lag on B steps: mean / max |" in text
    assert "| held-out eval F1: last / best | 0.2500 (step 40) / 0.3000 (step 20) |" in text
    assert "| held-out eval AP: last / best | 0.1250 (step 40) / 0.1250 (step 40) |" in text
    assert "![Precision-recall curve](report/pr_curve.png)" in text
    assert "| rollout F1 on B steps: last / best | 0.7600 (step 38) / 0.7600 (step 38) |" in text
    assert "| `loss/ce` | 7.5 (step 0) |" in text
    assert "torn last line" in text and "line(s): 41" in text
    assert "## Not plotted" not in text
    for name in (*TRAIN_AB_PLOTS, "samples_staleness", "samples_epochs"):
        assert f"](report/{name}.png)" in text
        assert_readable_png(run_dir / "report" / f"{name}.png")


def test_step_mode_run_without_b_steps_skips_plots_and_says_why(tmp_path: Path) -> None:
    run_dir = tmp_path / "a_only"
    write_jsonl(run_dir / "metrics.jsonl", train_ab_rows(5, "0", async_mode=False, skips=set()))
    write_config(run_dir, 0.0, "step", max_steps=20)
    (run_dir / "report").mkdir()
    (run_dir / "report" / "async_queue.png").write_bytes(b"stale plot of an earlier report")

    result = run_cli("report", str(run_dir), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "not plotted: rollout precision/recall/F1" in result.stdout
    text = (run_dir / "report.md").read_text()
    assert "| Channel-A / Channel-B steps | 5 / 0 |" in text
    assert "| rollout F1 on B steps: last / best | n/a / n/a |" in text
    assert "dropped packs" not in text  # no async rows in a step-mode report
    assert "- rollout precision/recall/F1: no Channel-B step with rollout metrics in this run." in text
    assert "- async queue depth / ver_lag: step-mode run" in text
    assert "partial run: the last logged step is 4 of `training.max_steps` = 20." in text
    assert "no `final_state.json`" in text
    assert sorted(p.name for p in (run_dir / "report").iterdir()) == [
        "b_ratio.png",
        "loss.png",
        "optimizer.png",
        "phases.png",
        "timing.png",
    ]
    for path in (run_dir / "report").iterdir():
        assert_readable_png(path)


def stage_b_mission(mission_dir: Path, accuracies: list[float]) -> None:
    selections, metrics = [], []
    step = 0
    for w, accuracy in enumerate(accuracies):
        num_right = round(4 * accuracy)
        for i in range(4):
            label = "fail" if i % 2 else "pass"
            verdict = label if i < num_right else ("pass" if label == "fail" else "fail")
            selections.append(
                {"epoch": 0, "batch_index": w, "guidance_step": step, "ticket_key": f"g{w}{i}::{label}",
                 "label": label, "verdict": verdict, "vote_strength": 1.0,
                 "num_pass": 2 * (verdict == "pass"), "num_fail": 2 * (verdict == "fail"),
                 "num_malformed": 0, "label_match": verdict == label}
            )  # fmt: skip
        changed = w == 1
        step += changed
        metrics.append(
            {"window": w, "epoch": 0, "last_batch_index": w, "num_batches": 1, "guidance_step": step,
             "num_tickets": 4, "accuracy": accuracy, "fp_rate": 0.5 * (1 - accuracy), "fn_rate": 0.0,
             "num_fp": 0, "num_fn": 0, "num_no_verdict": 0, "malformed_rate": 0.0,
             "num_reflections": int(changed), "num_guidance_changes": int(changed),
             "tickets_per_s": 2.0, "elapsed_s": 2.0}
        )  # fmt: skip
    write_jsonl(mission_dir / "selections.jsonl", selections)
    write_jsonl(mission_dir / "metrics.jsonl", metrics)
    write_jsonl(
        mission_dir / "reflection.jsonl",
        [{"guidance_step_before": 0, "guidance_step_after": 1, "changed": True,
          "accepted": [{"op": "add", "keys": ["G2"], "text": "red means fail"}], "dropped": []}],
    )  # fmt: skip
    guidance = {"step": 1, "experiences": {"G0": "Judge every image.", "G1": "A | pipe\nand a newline"}}
    (mission_dir / "guidance.json").write_text(json.dumps(guidance))
    for name in ("trajectories.jsonl", "need_review_queue.jsonl", "failure_malformed.jsonl"):
        (mission_dir / name).write_text("")


def test_stage_b_parent_reports_every_mission(tmp_path: Path) -> None:
    root = tmp_path / "stage_b"
    stage_b_mission(root / "tiny" / "shapes_qc", [0.5, 0.5, 1.0, 1.0])
    stage_b_mission(root / "tiny" / "colors_qc", [0.25, 0.75])
    (root / "tiny" / "empty_qc").mkdir(parents=True)
    (root / "tiny" / "empty_qc" / "selections.jsonl").write_text("")

    result = run_cli("report", str(root), timeout=120)
    assert result.returncode == 0, result.stderr
    index = (root / "report.md").read_text()
    summary = "16 tickets, accuracy 0.5 → 1, guidance step 0 → 1"
    assert f"| tiny/shapes_qc | {summary} | [tiny/shapes_qc/report.md](tiny/shapes_qc/report.md) |" in index
    assert "| tiny/colors_qc | 8 tickets, accuracy 0.25 → 0.75" in index
    assert "| tiny/empty_qc | no report: no Stage-B metrics rows in" in index

    mission = root / "tiny" / "shapes_qc"
    text = (mission / "report.md").read_text()
    assert text.startswith("# Stage-B report: shapes_qc")
    assert "| tickets judged | 16 (4 global batches, 4 logging windows) |" in text
    assert "| accuracy: first / last window | 0.5 / 1 |" in text
    assert "| accuracy over all tickets | 0.75 |" in text
    assert "| false pass (fail judged pass): count / rate | 2 / 0.25 |" in text
    assert "| guidance step: first / last | 0 / 1 |" in text
    assert "| reflections: run / changed guidance | 1 / 1 |" in text
    assert "| guidance operations: accepted / dropped | 1 / 0 |" in text
    assert "| G1 | A \\| pipe and a newline |" in text
    for name in ("accuracy", "guidance_step"):
        assert f"](report/{name}.png)" in text
        assert_readable_png(mission / "report" / f"{name}.png")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: None, "error: run directory not found: "),
        (lambda d: d.mkdir(), "error: no metrics.jsonl in "),
        (
            lambda d: write_jsonl(d / "metrics.jsonl", [], torn_tail='{"step": 0, "ki'),
            "error: no metrics rows in ",
        ),
    ],
)
def test_errors_are_one_line_exit_1(tmp_path: Path, make: Any, message: str) -> None:
    run_dir = tmp_path / "run"
    make(run_dir)
    result = run_cli("report", str(run_dir), timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert not (run_dir / "report.md").exists()


def write_ablation_run(path: Path, b_ratio: float, target: str, seed: int, hits: list[int]) -> None:
    """A run dir as train-ab leaves it, for comparison: config, eval rows with per-image counters, timings."""
    path.mkdir(parents=True)
    config = {
        "training": {"seed": seed, "max_steps": 4},
        "stage2_ab": {"schedule": {"b_ratio": b_ratio}, "channel_b": {"target": target}},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    fields = ["n_gt", "n_valid", "n_matched", "n_invalid", "n_truncated", "n_dup", "n_matched_desc"]
    evals = []
    for step in (2, 4):
        per_image = [[2, 2, h, 0, 0, 0, min(h, 1)] for h in hits]  # one hit per image has the right desc
        matched = sum(hits)
        f1 = matched / (2 * len(hits))
        evals.append({"step": step, "f1": f1, "per_image_fields": fields, "per_image": per_image})
    write_jsonl(path / "eval.jsonl", evals)
    # the scored predictions train-ab writes beside them: a hit is the GT box itself, a miss lands elsewhere
    images, anns, preds = [], [], []
    for image_id, h in enumerate(hits, start=1):
        images.append({"id": image_id, "width": 100, "height": 100, "file_name": f"{image_id}.png"})
        for k in range(2):
            box = [10.0 + 40 * k, 10.0, 30.0, 30.0]
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": image_id,
                    "category_id": 1,
                    "bbox": box,
                    "area": 900.0,
                    "iscrowd": 0,
                }
            )
            guess = box if k < h else [70.0, 70.0, 20.0, 20.0]
            preds.append({"image_id": image_id, "category_id": 1, "bbox": guess, "score": 0.9 - 0.1 * k})
    gt = {"images": images, "annotations": anns, "categories": [{"id": 1, "name": "red circle"}]}
    (path / "eval_gt.coco.json").write_text(json.dumps(gt))
    write_jsonl(path / "eval_predictions.jsonl", [{"step": s, "predictions": preds} for s in (2, 4)])
    write_jsonl(path / "metrics.jsonl", [{"step": s, "kind": "A", "time/step_s": 0.5} for s in range(4)])


def test_report_compares_several_runs_with_intervals(tmp_path: Path) -> None:
    runs = []
    for seed in (0, 1):
        runs.append(tmp_path / f"a{seed}")
        write_ablation_run(runs[-1], 0.0, "raw_prefix", seed, [1, 2, 1, 1] * 20)  # F1 0.625
        runs.append(tmp_path / f"ab{seed}")
        write_ablation_run(runs[-1], 0.5, "clean_prefix", seed, [2, 2, 2, 1] * 20)  # F1 0.875
    out = tmp_path / "cmp"
    result = run_cli("report", *map(str, runs), "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    text = (out / "comparison.md").read_text()
    a_row = next(line for line in text.splitlines() if line.startswith("| A-only |"))
    ab_row = next(line for line in text.splitlines() if line.startswith("| AB b=0.5 clean_prefix |"))
    header = next(line for line in text.splitlines() if line.startswith("| variant |"))
    assert "| AP | ΔAP vs A-only | F1 box | F1 desc | desc accuracy |" in header
    a_cells = [c.strip() for c in a_row.strip("|").split("|")]
    ab_cells = [c.strip() for c in ab_row.strip("|").split("|")]
    assert a_cells[1:3] == ["2", "4"]  # two seeds, compared at the last common eval step
    assert a_cells[5].startswith("0.625 [") and ab_cells[5].startswith("0.875 [")  # F1 box
    assert ab_cells[-2].startswith("+0.250 [")  # ΔF1, paired on images
    assert a_cells[7].startswith("0.800 [") and ab_cells[7].startswith(
        "0.571 ["
    )  # desc accuracy: 1 of 1.25 / 1.75
    assert float(ab_cells[4].split()[0]) > 0 and a_cells[4] == "—"  # ΔAP: AB finds more boxes
    with Image.open(out / "comparison_f1.png") as image:
        assert image.size[0] >= 400
    assert "A-only" in result.stdout
    page = (out / "comparison.html").read_text()  # the page: the same table, the plot
    assert "<td>A-only</td>" in page and 'src="comparison_f1.png"' in page

    no_eval = tmp_path / "no_eval"
    no_eval.mkdir()
    (no_eval / "config.yaml").write_text("training: {seed: 0}\n")
    failed = run_cli("report", str(runs[0]), str(no_eval), "--out", str(out), timeout=120)
    assert failed.returncode == 1 and "no held-out eval rows" in failed.stderr
