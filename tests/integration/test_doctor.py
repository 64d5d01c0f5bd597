"""`stagectl doctor` as a user runs it: a good config passes with one line per check (exit 0); a config
whose samples do not fit `global_max_length` fails in `--json` (exit 1) and names the check."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.integration.helpers import run_cli, tiny_train_config, write_config

pytestmark = pytest.mark.integration

LINE = re.compile(r"^(OK|WARN|FAIL|SKIP) +[a-z_.\[\]0-9]+: .+$")


def test_doctor_passes_a_good_config_and_fails_a_bad_one_in_json(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", tiny_train_config(tmp_path))
    good = run_cli("doctor", str(config), timeout=300)
    assert good.returncode == 0, good.stdout + good.stderr
    lines = good.stdout.strip().splitlines()
    assert all(LINE.match(line) for line in lines[:-1]), lines
    names = [line.split()[1].rstrip(":") for line in lines[:-1]]
    assert {
        "config",
        "training.output_dir",
        "data.file",
        "model.load",
        "resources.disk",
        "data.longest_sample",
        "packing.forward",
    } <= set(names)
    assert lines[-1].startswith("doctor passed: ")
    assert not (tmp_path / "run").exists()  # a preflight leaves no run directory

    bad = run_cli("doctor", str(config), "--set", "global_max_length=100", "--json", timeout=300)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    report = json.loads(bad.stdout)
    assert report["ok"] is False
    failed = {c["name"]: c for c in report["checks"] if c["status"] == "fail"}
    assert set(failed) == {"data.longest_sample", "packing.forward"}
    assert "exceed global_max_length 100" in failed["data.longest_sample"]["message"]
