"""The learning check's separated phase (bench/learning_separated.py) without training anything: its runs'
overrides against the real config schema, their pinning and one-at-a-time order, the merge into saved
results, and the BENCHMARKS.md sub-section from a fabricated result."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench import bench_learning, learning_separated
from bench.learning_separated import A2, AB
from bench.markdown_learning import learning_section as learning
from bench.markdown_learning import separated_section
from stagectl.config.loader import load_config


def _overrides(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_separated_runs_validate_against_the_schema_pinned_as_described(tmp_path: Path) -> None:
    sizes = bench_learning.FULL
    config = bench_learning._task_config("dense", sizes, tmp_path / "dense.yaml")
    checkpoint = tmp_path / "dense-stage1" / "checkpoint-2500" / "model"
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the config validator checks the pinned CPUs against this process's (needs 2)")
    learner, server = learning_separated.two_cores()
    jobs = learning_separated.separated_jobs("dense", config, checkpoint, sizes, tmp_path, (learner, server))

    assert [j.name for j in jobs] == [
        f"sep-dense-{v}-seed{s}" for s in range(sizes.seeds) for v in ("AB_async_separated", "A-only_2_cores")
    ]
    assert all(j.after is None and not j.name.startswith("dense-") for j in jobs)  # not in the 1-core tables
    ab = load_config(config, _overrides(jobs[0].argv))
    a2 = load_config(config, _overrides(jobs[1].argv))
    for cfg in (ab, a2):  # the learning config's settings stand, in async mode too
        assert cfg.model.name_or_path == str(checkpoint)
        assert cfg.training.packing is False and cfg.training.per_device_train_batch_size == 8
        assert cfg.data is not None and cfg.data.eval is not None
        assert cfg.data.eval.every_steps == sizes.phase2_steps // 2
        assert cfg.training.learning_rate == sizes.phase2_lr and cfg.training.lr_scheduler_type == "constant"
    assert ab.stage2_ab is not None and ab.stage2_ab.channel_b.mode == "async"
    assert ab.stage2_ab.schedule.b_ratio == 0.5 and ab.stage2_ab.channel_b.target == "clean_prefix"
    assert ab.rollout_server.embedded and ab.rollout_server.engine == "hf"
    assert ab.launch.cpus == [learner] and ab.rollout_server.cpus == [server]
    assert ab.launch.prefetcher_cpus == "server"
    assert ab.training.max_steps == sizes.phase2_steps
    assert a2.stage2_ab is not None and a2.stage2_ab.schedule.b_ratio == 0
    assert a2.launch.cpus == [learner, server] and a2.rollout_server.cpus is None
    assert a2.training.max_steps == bench_learning.A_ONLY_FACTOR * sizes.phase2_steps
    # the arm the confirmation chose: its variant's keys and its b_ratio
    arm = ("reordered_gt desc_matched unmasked", 0.1)
    [chosen, _, *_] = learning_separated.separated_jobs(
        "dense", config, checkpoint, sizes, tmp_path, (learner, server), arm
    )
    cfg = load_config(config, _overrides(chosen.argv))
    assert cfg.stage2_ab is not None and cfg.stage2_ab.schedule.b_ratio == 0.1
    cb = cfg.stage2_ab.channel_b
    assert (cb.target, cb.desc_ce_weight_matched, cb.mask_correct_matched_desc) == (
        "reordered_gt",
        1.0,
        False,
    )
    assert cb.mode == "async"


def test_choose_arm_takes_the_best_mean_delta_at_equal_training_time() -> None:
    def row(variant: str, b: float, d: float) -> dict[str, Any]:
        return {
            "variant": variant,
            "b_ratio": b,
            "wall": {"d_AP": {"value": d, "low": d - 0.01, "high": d + 0.01}},
        }

    tasks = {
        "sparse": {"confirm": [{"variant": "A-only"}, row("x", 0.1, 0.02), row("y", 0.25, 0.03)]},
        "dense": {"confirm": [{"variant": "A-only"}, row("x", 0.1, 0.02), row("y", 0.25, -0.02)]},
    }
    assert learning_separated.choose_arm(tasks) == ("x", 0.1)  # y's mean is 0.005
    assert learning_separated.choose_arm({}) == learning_separated.DEFAULT_ARM


def test_separated_phase_runs_one_job_at_a_time_on_the_first_two_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[list[str], int]] = []

    def fake_run_jobs(jobs: list[bench_learning.Job], workers: int, log_dir: Path) -> dict[str, float]:
        calls.append(([j.name for j in jobs], workers))
        return {j.name: 1.0 for j in jobs}

    monkeypatch.setattr(learning_separated, "run_jobs", fake_run_jobs)
    monkeypatch.setattr(learning_separated, "analyse_task", lambda task, out, sizes: {"task": task})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {9, 3, 5})
    sizes = bench_learning.FULL
    configs = {t: tmp_path / f"{t}.yaml" for t in sizes.tasks}
    part = learning_separated.run_phase(
        configs, {t: tmp_path / t for t in sizes.tasks}, sizes, tmp_path, tmp_path, tasks=("sparse", "dense")
    )

    assert part["cores"] == [3, 5]
    [(names, workers)] = calls
    assert workers == 1 and len(names) == 2 * 2 * sizes.seeds
    assert part["tasks"] == {"sparse": {"task": "sparse"}, "dense": {"task": "dense"}}

    (tmp_path / "sep-dense-A-only_2_cores-seed1").mkdir()
    with pytest.raises(
        ValueError, match="already holds unfinished separated runs \\(sep-dense-A-only_2_cores-seed1\\)"
    ):
        learning_separated.refuse_existing(tmp_path, sizes)
    finished = {"global_step": 200, "max_steps": 200, "stopped_by_signal": None}
    (tmp_path / "sep-dense-A-only_2_cores-seed1" / "final_state.json").write_text(json.dumps(finished))
    learning_separated.refuse_existing(tmp_path, sizes)  # a finished run is kept, not run again
    learning_separated.refuse_existing(tmp_path / "elsewhere", sizes)

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2})
    with pytest.raises(ValueError, match=r"needs 2 CPUs.*may run on 1: \[2\]"):
        learning_separated.two_cores()


def _separated(ab_s: float = 120.0) -> dict[str, Any]:
    table = ["| variant | seeds |", "|---|---|", f"| {A2} | 3 |", f"| {AB} | 3 |"]
    return {
        "cores": [0, 1],
        "ab_target": "clean_prefix",
        "run_wall_s": {},
        "phase_s": 600.0,
        "ran_at": "2026-11-26 05:00:00",
        "stage1_reused": ["sparse"],
        "stage1_wall_s": {},
        "total_s": 660.0,
        "tasks": {
            "sparse": {
                "step": 200,
                "table": table,
                "train_s": {AB: ab_s, A2: 60.0},
                "equal_wall": {
                    "ab_train_s": ab_s,
                    "a_only_steps": [400],
                    "a_only_train_s": [119.0, 121.0, 120.0],
                    "table": table,
                    "delta_f1": {"value": -0.004, "low": -0.02, "high": 0.012},
                },
                "f1": {
                    "start": 0.80,
                    AB: 0.92,
                    A2: 0.90,
                    "delta_equal_steps": {"value": 0.02, "low": 0.004, "high": 0.04},
                    "a_only_end_step": 400,
                    "a_only_end": 0.916,
                },
                "overlap": {
                    "train_s": ab_s,
                    "wait_packs_s": 10.0,
                    "fence_s": 2.0,
                    "weight_sync_s": 6.0,
                    "idle_fraction": 0.1,
                    "ver_lag_mean": 0.5,
                    "drop_rate": 0.05,
                    "b_ratio_realized": 0.5,
                    "prefetch_busy_s": 100.0,
                },
            }
        },
    }


def test_separated_section_reads_its_numbers() -> None:
    r = {"sizes": {"phase2_steps": 200}, "a_only_factor": 2, "separated": _separated()}
    text = "\n".join(separated_section(r))

    assert "### Separated placement" in text and "learner on CPU 0, server and prefetcher on CPU 1" in text
    assert "Stage-1 checkpoints reused: sparse" in text
    assert f"| {AB} | 3 |" in text
    assert f"{AB} reached step 200 in 120 s of training vs {A2} 60 s (wall ratio per step 2.00)" in text
    assert "At equal steps ΔF1 = +0.020 [+0.004, +0.040]" in text
    assert "ΔF1 = -0.004 [-0.020, +0.012]" in text
    # A-only's slope past step 200: (0.916 - 0.900) / 200 = +0.080 per 1,000 steps; 1.00 x 200 more steps
    assert "gains +0.080 F1 per 1,000 steps past step 200" in text and "worth +0.016 F1" in text
    # AB's lead is read with its interval: +0.020 clears the +0.0128 a no-idle AB would need, its low end does not
    assert "must exceed that (measured +0.020 [+0.004, +0.040])" in text
    assert (
        "worth +0.013 F1, so the same lead would be enough on its point estimate (its interval reaches"
        in text
    )
    behind = _separated()
    behind["tasks"]["sparse"]["f1"]["delta_equal_steps"] = {"value": 0.01, "low": -0.01, "high": 0.03}
    assert "would be still not enough on its point estimate (its interval reaches above that)." in "\n".join(
        separated_section({**r, "separated": behind})
    )
    # from the checkpoint: AB 0.12 / 200 = +0.600 per 1,000 steps, A-only +0.500; AB needs 2.00x, had 1.20x
    assert "AB needs 2.00x A-only's gain per step, it had 1.20x." in text
    # no idle: (120 - 12) / 60
    assert "idle 10%) and pushed weights for 6.0 s; with no idle the wall ratio would be 1.80" in text
    assert "drop rate 5.0%" in text
    assert "comes before AB's training time" not in text  # A-only's 400 steps cover AB's 2.00x

    slower = "\n".join(separated_section({**r, "separated": _separated(ab_s=150.0)}))
    assert "wall ratio per step 2.50" in slower and "A-only's last eval (step 400) comes before" in slower
    faster = "\n".join(separated_section({**r, "separated": _separated(ab_s=45.0)}))
    assert "no slower per step than A-only 2 cores here (0.75x)" in faster and "needs" not in faster


def test_merge_keeps_the_one_core_check_and_replaces_only_the_separated_part() -> None:
    saved = {
        "meta": {"ran_at": "2026-11-25 18:26:30", "seconds": 1677.6},
        "result": {
            "quick": False,
            "tasks": {"sparse": {"table": ["1-core"]}},
            "total_s": 1677.6,
            "separated": {"old": True},
        },
    }
    fresh = {"quick": False, "tasks": {}, "total_s": 660.0, "separated": _separated()}
    meta = {"ran_at": "2026-11-26 05:00:00", "seconds": 660.0}

    merged = learning_separated.merge(saved, fresh, meta)
    assert merged["meta"] == saved["meta"]
    assert merged["result"]["tasks"] == {"sparse": {"table": ["1-core"]}}
    assert merged["result"]["total_s"] == 1677.6
    assert merged["result"]["separated"] == fresh["separated"]
    assert saved["result"]["separated"] == {"old": True}  # the loaded dict is not modified
    assert learning_separated.merge(None, fresh, meta) == {"meta": meta, "result": fresh}
    quick = {"meta": saved["meta"], "result": {**saved["result"], "quick": True}}
    assert learning_separated.merge(quick, fresh, meta) == {"meta": meta, "result": fresh}


def test_learning_section_renders_the_separated_part_after_the_one_core_tables() -> None:
    r = {
        "sizes": {"phase2_steps": 200, "phase2_lr": 3e-4, "seeds": 3, "eval_images": {}},
        "a_only_factor": 2,
        "workers": 2,
        "tasks": {},
        "tasks_spec": {},
        "total_s": 1680.0,
        "separated": _separated(),
    }
    lines = learning(r)
    assert lines.index("Whole check: 28 min.") < lines.index(
        "### Separated placement: async AB vs A-only on the same two cores"
    )
    assert not any("Separated" in line for line in learning({**r, "separated": None}))


def test_save_merges_into_the_saved_check_and_rewrites_benchmarks_md(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from bench import document

    recorded = Path(document.RESULTS) / "learning.json"  # the committed full-size check
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "learning.json").write_text(recorded.read_text())
    monkeypatch.setattr(document, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(document, "ROOT", tmp_path)
    before = json.loads(recorded.read_text())
    fresh = {"quick": False, "tasks": {}, "total_s": 660.0, "separated": _separated()}

    learning_separated.save(fresh)

    saved = json.loads((tmp_path / "results" / "learning.json").read_text())
    assert saved["meta"] == before["meta"] and saved["result"]["tasks"] == before["result"]["tasks"]
    assert saved["result"]["separated"] == fresh["separated"]
    text = (tmp_path / "BENCHMARKS.md").read_text()
    one_core = text.index("### sparse task: 1-2 shapes")
    assert one_core < text.index("### Separated placement") < text.index("## Memory per rank")
