"""The CLI: light imports, validate-config exit codes and messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[3]
HEAVY = ("torch", "transformers", "vllm", "fastapi")


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stagectl", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )


def test_import_and_version_are_light() -> None:
    from importlib.metadata import version

    code = (
        "import sys, stagectl.cli.app, stagectl.config, stagectl.schedule\n"
        "try:\n"
        "    stagectl.cli.app.app(['--version'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [f"stagectl {version('stagectl')}", "[]"]


def test_validate_config_is_light(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from stagectl.cli.app import app\n"
        "try:\n"
        f"    app(['validate-config', {str(ROOT / 'examples/tiny/train_ab.yaml')!r}, '--gpu-memory-gb', '80'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in out.stdout


def test_help_lists_every_command() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for name in (
        "validate-config",
        "train-ab",
        "rollout-server",
        "stage-b",
        "demo-data",
        "tiny-model",
        "report",
        "convert",
    ):
        assert name in result.stdout


def test_validate_config_ok_prints_resolved() -> None:
    result = run_cli("validate-config", "examples/tiny/train_ab.yaml", "--format", "json")
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["stage2_ab"]["schedule"]["b_ratio"] == 0.25
    assert resolved["stage2_ab"]["channel_b"]["async"]["queue_limit"] == 8


def test_validate_config_set_override() -> None:
    result = run_cli("validate-config", "examples/tiny/train_ab.yaml", "--set", "training.max_steps=7")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["training"]["max_steps"] == 7


def test_validate_config_errors_exit_1_with_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "data": {"synthetic": {"num_samples": 4}},
                "stage2_ab": {"schedule": {"pattern": ["A", "B"]}},
                "training": {"max_step": 3},
            }
        )
    )
    result = run_cli("validate-config", str(bad))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "stage2_ab.schedule.pattern" in result.stderr and "stage2_ab.schedule.b_ratio" in result.stderr
    assert "training.max_step: unknown key" in result.stderr


def test_validate_config_world_size_flag() -> None:
    result = run_cli("validate-config", "examples/tiny/train_ab.yaml", "--world-size", "2")
    assert result.returncode == 1
    assert "stage2_ab.channel_b.mode: async" in result.stderr


def test_validate_config_memory_estimate_warns_over_budget(tmp_path: Path) -> None:
    from stagectl.memory.reference import REFERENCE_CONFIGS

    checkpoint = tmp_path / "qwen2.5-vl-7b"  # config.json alone: the estimate never reads weights
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(REFERENCE_CONFIGS["Qwen2.5-VL-7B"]))
    args = ["examples/tiny/train_ab.yaml", "--set", f"model.name_or_path={checkpoint}", "--format", "json"]
    over = run_cli("validate-config", *args, "--gpu-memory-gb", "80")
    assert over.returncode == 0, over.stderr
    assert json.loads(over.stdout)["model"]["name_or_path"] == str(checkpoint)  # stdout stays the config
    assert "8,292,166,656 params, world size 1, ddp" in over.stderr
    assert "optimizer        61.78 GiB" in over.stderr  # 2 x 4 bytes x 8.29B AdamW state
    assert (
        "warning: the estimated peak of 142.8 GiB per rank exceeds --gpu-memory-gb (80.0 GiB)" in over.stderr
    )
    under = run_cli("validate-config", *args, "--gpu-memory-gb", "200")
    assert under.returncode == 0 and "total" in under.stderr and "warning" not in under.stderr


def test_validate_config_missing_file() -> None:
    result = run_cli("validate-config", "does/not/exist.yaml")
    assert result.returncode == 1
    assert "config file not found: does/not/exist.yaml" in result.stderr


def test_schema() -> None:
    result = run_cli("validate-config", "--schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert "stage2_ab" in schema["properties"]
    assert schema["$defs"]["ScheduleConfig"]["properties"]["b_ratio"]["description"].startswith("Fraction")
