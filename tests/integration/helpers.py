"""Shared helpers for integration tests: run the real CLI as a subprocess, write tiny configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from stagectl.launch import kill_tree

ROOT = Path(__file__).parents[2]


def run_cli(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python -m stagectl ARGS` to completion. On timeout, the CLI and every process it started
    (torchrun and its ranks live in sessions of their own) are killed, and the test fails with the
    run's last output instead of leaving orphans behind."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("WORLD_SIZE", None)
    argv = [sys.executable, "-m", "stagectl", *args]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=full_env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid, grace_s=0.0)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"stagectl {' '.join(args)} still running after {timeout:g} s; killed it and every process it "
            f"started. Last output:\n{stdout[-2000:]}\n{stderr[-4000:]}"
        ) from None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def tiny_train_config(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    """A small, fast Stage-2 AB config on synthetic shapes; `sections` deep-merge over it."""
    cfg: dict[str, Any] = {
        "model": {"name_or_path": "builtin:tiny-qwen2.5-vl"},
        "data": {"synthetic": {"num_samples": 32, "seed": 0, "image_size": 112, "max_objects": 2}},
        "global_max_length": 512,  # a packed micro-batch holds 2-3 samples
        "training": {
            "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "learning_rate": 1e-3,
            "max_steps": 2,
            "output_dir": str(tmp_path / "run"),
        },
        "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf", "max_new_tokens": 24}}},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "step"}},
    }
    return deep_merge(cfg, sections)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def greedy_ids(url: str) -> list[list[int]]:
    """A server's greedy token ids for three fixed prompts (what a weight sync must reproduce)."""
    import httpx

    prompts = ["Describe the picture.", "List the objects as JSON.", "object_1"]
    body = {
        "infer_requests": [{"messages": [{"role": "user", "content": p}]} for p in prompts],
        "request_config": {"max_tokens": 12, "temperature": 0, "return_details": True},
    }
    answer = httpx.post(f"{url}/infer/", json=body, timeout=60).raise_for_status().json()
    return [item["response"]["choices"][0]["token_ids"] for item in answer]  # swift's RolloutOutput shape


@contextmanager
def in_process_server(model: str, *sets: str) -> Iterator[str]:
    """The URL of a rollout server for `model` (`sets`: `--set` overrides) run in this process on one
    torch thread: what `stagectl rollout-server --model MODEL --port 0 --set ...` (with OMP_NUM_THREADS=1)
    builds, the same config, engine, service and app (weight-sync routes and the weight-stream port
    included), without a process of its own, whose start-up costs more CPU (~5 s) than a tiny model's
    answers. For a server a test talks to, not one it kills or whose CLI it tests; stopped on exit."""
    import torch

    from stagectl.config import load_config
    from stagectl.config.plan_server import server_plan
    from stagectl.server.app import build_app
    from stagectl.server.service import RolloutService
    from stagectl.server.serving import ThreadedServer, build_engine, settings_for

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = server_plan(load_config(None, [f"model.name_or_path={model}", "rollout_server.port=0", *sets]))
        server = ThreadedServer(build_app(RolloutService(build_engine(plan), settings_for(plan)))).start(
            timeout_s=120
        )
        try:
            yield server.url
        finally:
            server.stop()
    finally:
        torch.set_num_threads(threads)


def base_state() -> dict[str, Any]:
    """The tiny Qwen2.5-VL's float32 state dict, as the learner loads it before training."""
    from stagectl.models.loading import load_bundle

    return {k: v.detach() for k, v in load_bundle("builtin:tiny-qwen2.5-vl").model.state_dict().items()}


def external_server_overrides(out: Path, url: str) -> list[str]:
    """`--set` arguments that point an example config's run at `out` and at an external server `url`
    instead of its embedded one."""
    sets = {
        "training.output_dir": str(out),
        "rollout_server.embedded": "false",
        "custom.extra.rollout_matching.vllm.server.servers": f"[{{base_url: '{url}'}}]",
    }
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def check_phase_times(rows: list[dict[str, Any]]) -> None:
    """Every row logs the learner's phases (`time/<phase>_s`), none negative, together at most the step's
    wall time; every step runs forward/backward, and a B step waits for or builds its packs somewhere."""
    from stagectl.timing import PHASES

    for r in rows:
        phases = {p: r[f"time/{p}_s"] for p in PHASES}
        assert all(v >= 0 for v in phases.values()), (r["step"], phases)
        assert sum(phases.values()) <= r["time/step_s"] + 1e-6, (r["step"], phases, r["time/step_s"])
        assert phases["forward_backward"] > 0, r["step"]
        assert phases["optimizer"] > 0, r["step"]


def async_config(tmp_path: Path, **sections: object) -> dict:
    """The 2-rank async actor-learner on the tiny model with an embedded rollout server (the async
    example's topology, 8 steps); `sections` deep-merge over it."""
    base = tiny_train_config(
        tmp_path,
        training={"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2, "max_steps": 8},
        launch={"nproc_per_node": 2, "watchdog": {"step_s": 120}},
        custom={
            "extra": {
                "rollout_matching": {
                    "rollout_backend": "vllm",
                    "max_new_tokens": 24,
                    "vllm": {"mode": "server", "server": {"timeout_s": 60}},
                }
            }
        },
        stage2_ab={
            "schedule": {"b_ratio": 0.5},
            "channel_b": {
                "mode": "async",
                "rollout_decode_batch_size": 4,
                "async": {
                    "queue_limit": 8,
                    "version_window": 1,
                    "prefetch_target_packs": 4,
                    "sync_every_steps": 2,
                },
            },
        },
        rollout_server={"embedded": True, "max_batch_size": 8},
    )
    return deep_merge(base, sections)  # type: ignore[arg-type]


def check_async_invariants(rows: list[dict], window: int) -> None:
    """Every logged row of a 2-rank async run (GAS 2, b_ratio 0.5) keeps the schedule's and the window's promises."""
    from stagectl.schedule import channel_for_step

    for r in rows:
        wanted = channel_for_step(r["step"], 0.5)
        assert r["policy_wants_b"] == (wanted == "B")
        if r["stage2_ab/async/b_step_skipped_due_to_queue"]:
            assert wanted == "B" and r["kind"] == "A"
        else:
            assert r["kind"] == wanted
        if r["kind"] == "B":
            assert 0 <= r["stage2_ab/async/ver_lag"] <= window
            assert r["num_backward"] == 2  # rank 0: one forward/backward per micro-step (GAS = 2)
            assert r["packing/n_packs"] == 2 * 2  # one pack per micro-step on each of the 2 ranks
            assert "rollout/f1" in r


# ------------------------------------------------------------------ stage-b

MISSION = "qc"
REFLECTION_BATCH = 3
OTHERS = ["blue", "green", "yellow", "cyan", "teal", "white", "black", "grey", "pink"]


def write_inputs(tmp: Path) -> tuple[Path, Path]:
    """16 usable tickets (9 red fails, 5 passes, 1 unreadable, 1 ambiguous) plus 2 bad lines."""
    rows: list[Any] = []
    for k in range(9):
        per_image = {"image_1": f"{OTHERS[k]} circle near the top", "image_2": "red square near the centre"}
        rows.append({"mission": MISSION, "group_id": f"f{k}", "label": "fail", "per_image": per_image})
    for k in range(5):
        per_image = {"image_1": f"{OTHERS[k]} triangle", "image_2": f"{OTHERS[k + 1]} square"}
        rows.append({"mission": MISSION, "group_id": f"p{k}", "label": "pass", "per_image": per_image})
    rows.append(
        {"mission": MISSION, "group_id": "u0", "label": "pass", "per_image": {"image_1": "unreadable"}}
    )
    rows.append(
        {"mission": MISSION, "group_id": "a0", "label": "fail", "per_image": {"image_1": "ambiguous blob"}}
    )
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, "{broken json")
    lines.insert(
        7, json.dumps({"mission": MISSION, "group_id": "x", "label": "maybe", "per_image": {"image_1": "a"}})
    )
    tickets = tmp / "tickets.jsonl"
    tickets.write_text("\n".join(lines) + "\n")
    guidance = tmp / "guidance.json"
    experiences = {"G0": "judge the group", "G1": "purple means fail", "S1": "a rule written by people"}
    guidance.write_text(json.dumps({"step": 0, "updated_at": "", "experiences": experiences}))
    return tickets, guidance


def stage_b_config(tmp: Path, **sections: Any) -> dict[str, Any]:
    """A `stage-b` config on the deterministic rules engine over `write_inputs`' tickets; `sections`
    deep-merge over it."""
    tickets, guidance = write_inputs(tmp)
    cfg: dict[str, Any] = {
        "mission": MISSION,
        "tickets": [str(tickets)],
        "guidance": {"path": str(guidance), "retention": 50},
        "output": {"root": str(tmp / "out"), "run_name": "r"},
        "sampler": {"grid": [{"seed": 0}, {"seed": 1}], "samples_per_decode": 2},
        # write_inputs' 2 bad lines: skipped on request (unit tests cover the refusal)
        "runner": {
            "engine": "rules",
            "epochs": 2,
            "per_rank_rollout_batch_size": 2,
            "seed": 7,
            "bad_ticket_lines": "skip",
        },
        "reflection": {"batch_size": REFLECTION_BATCH, "max_operations": 2},
        "manual_review": {"min_vote_strength": 0.6},
        "launch": {"watchdog": {"step_s": 60}},
    }
    return deep_merge(cfg, sections)
