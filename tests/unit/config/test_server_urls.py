"""Rollout-server URLs (`vllm.server.servers[].base_url`, Stage-B's `runner.server.base_urls`) are checked at
load: a URL no request can reach was a traceback (`http://[::1`), or a start-up wait of `timeout_s` (120 s)
for its `/health/` before train-ab said the URL has no protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from stagectl.config import ConfigError, load_config

TRAIN_KEY = "custom.extra.rollout_matching.vllm.server.servers.0.base_url"


def _train(url: Any) -> dict[str, Any]:
    server = {"servers": [{"base_url": url}]}
    return {
        "data": {"synthetic": {"num_samples": 8}},
        "custom": {"extra": {"rollout_matching": {"rollout_backend": "vllm", "vllm": {"server": server}}}},
        "stage2_ab": {"schedule": {"b_ratio": 0.25}},
    }


def _stage_b(url: str) -> dict[str, Any]:
    return {
        "mission": "m",
        "tickets": ["t.jsonl"],
        "guidance": {"path": "g.json"},
        "runner": {"engine": "server", "server": {"base_urls": [url]}},
    }


def _problems(tmp_path: Path, data: dict[str, Any]) -> list[tuple[str, str]]:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return [(p.path, p.message) for p in info.value.problems]


BAD = [
    ("http://[::1", "'http://[::1' is not a URL (Invalid IPv6 URL); write http://HOST:PORT"),
    ("http://h:99999", "'http://h:99999' is not a URL (Port out of range 0-65535); write http://HOST:PORT"),
    ("notaurl", "'notaurl' is not an http:// or https:// URL with a host; write http://HOST:PORT"),
    (
        "127.0.0.1:8000",
        "'127.0.0.1:8000' is not an http:// or https:// URL with a host; write http://HOST:PORT",
    ),
    ("http://", "'http://' is not an http:// or https:// URL with a host; write http://HOST:PORT"),
    ("ftp://h", "'ftp://h' is not an http:// or https:// URL with a host; write http://HOST:PORT"),
    ("http://h:0", "'http://h:0': port 0 is no server's port; write http://HOST:PORT"),
    (
        "http://h:8000/infer/",
        "'http://h:8000/infer/' names an endpoint ('/infer/'); the client adds the endpoints itself: "
        "write http://HOST:PORT, the server's root",
    ),
    (
        "http://h:8000/?x=1",
        "'http://h:8000/?x=1' has '?x=1' after the path; write http://HOST:PORT (a path prefix allowed)",
    ),
]


@pytest.mark.parametrize(("url", "message"), BAD)
def test_a_server_url_no_request_can_reach_is_one_problem_at_its_key(
    tmp_path: Path, url: str, message: str
) -> None:
    assert _problems(tmp_path, _train(url)) == [(TRAIN_KEY, message)]
    assert _problems(tmp_path, _stage_b(url)) == [("runner.server.base_urls", message)]


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000",
        "https://h.example/",
        "http://[::1]:8000",
        "http://h",
        "https://gw.example/rollout-0/",
    ],
)
def test_server_urls_that_name_a_host_load(tmp_path: Path, url: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_train(url)))
    assert load_config(path).custom.extra.rollout_matching.vllm.server.servers[0].base_url == url
    path.write_text(yaml.safe_dump(_stage_b(url)))
    assert load_config(path).runner.server.base_urls == [url]


def test_a_required_key_with_a_bad_value_is_not_also_reported_missing(tmp_path: Path) -> None:
    """The retry that drops a bad key to check the rest reported it again as `required; set it`."""
    assert _problems(tmp_path, _train(123)) == [(TRAIN_KEY, "Input should be a valid string; got 123")]
