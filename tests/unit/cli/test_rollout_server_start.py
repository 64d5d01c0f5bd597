"""A rollout-server start refused before the engine loads the model: a chat template that does not compile
(it started, said it was listening and answered every /infer/ with HTTP 500)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app


def test_a_chat_template_that_does_not_compile_is_refused_before_the_engine_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stagectl.server.serving

    def serve(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("the server started (its engine loads the model) with a broken chat template")

    monkeypatch.setattr(stagectl.server.serving, "run_server", serve)
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    (checkpoint / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }{% endfor %}")
    result = CliRunner().invoke(app, ["rollout-server", "--model", str(checkpoint), "--port", "0"])
    assert result.exit_code == 1, result.output
    assert (
        f"error: model.name_or_path: {checkpoint / 'chat_template.jinja'}: the chat template does not compile "
        "(line 1): "
    ) in result.output
