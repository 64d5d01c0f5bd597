"""The learner at scale, on 2 gloo ranks: FSDP2 against DDP, sharded checkpoints, mixed precision, freezing,
and weight sync from shards. One run per topology; the rest is checked on what those runs leave behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.helpers import (
    base_state,
    external_server_overrides,
    greedy_ids,
    in_process_server,
    read_metrics,
    run_cli,
    tiny_train_config,
    write_config,
)


def _a_only(tmp_path: Path, name: str, parallelism: str, **training: object) -> dict:
    return tiny_train_config(
        tmp_path,
        training={
            "gradient_accumulation_steps": 2,
            "max_steps": 4,
            "save_steps": 2,
            "learning_rate": 1e-3,
            "output_dir": str(tmp_path / name),
            "parallelism": parallelism,
            **training,
        },
        launch={"nproc_per_node": 2, "watchdog": {"step_s": 120}},
        stage2_ab={"schedule": {"b_ratio": 0.0}, "channel_b": {"mode": "step"}},
    )


def _train(tmp_path: Path, cfg: dict, name: str) -> list[dict]:
    result = run_cli("train-ab", str(write_config(tmp_path / f"{name}.yaml", cfg)), timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(Path(cfg["training"]["output_dir"]))


@pytest.fixture(scope="module")
def fsdp_and_ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp_path = tmp_path_factory.mktemp("fsdp")
    ddp = _train(tmp_path, _a_only(tmp_path, "ddp", "ddp"), "ddp")
    fsdp = _train(tmp_path, _a_only(tmp_path, "fsdp", "fsdp"), "fsdp")
    return {"tmp": tmp_path, "ddp": ddp, "fsdp": fsdp}


def test_fsdp_trains_the_same_losses_as_ddp(fsdp_and_ddp: dict) -> None:
    ddp, fsdp = fsdp_and_ddp["ddp"], fsdp_and_ddp["fsdp"]
    assert [r["step"] for r in fsdp] == [0, 1, 2, 3]
    for a, b in zip(ddp, fsdp, strict=True):
        # same data, same seed, float32: only the reduction order differs (all-reduce vs reduce-scatter)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert b["optim/update_nonzero_frac"] == pytest.approx(a["optim/update_nonzero_frac"], abs=0.02)
    tmp = fsdp_and_ddp["tmp"]
    assert (tmp / "fsdp" / "checkpoint-4" / "train_state").is_dir()
    assert not (tmp / "fsdp" / "checkpoint-4" / "optimizer.pt").exists()
    assert (tmp / "ddp" / "checkpoint-4" / "optimizer.pt").is_file()


def test_fsdp_resume_is_exact(fsdp_and_ddp: dict) -> None:
    tmp = fsdp_and_ddp["tmp"]
    resumed_dir = tmp / "fsdp_resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp / "fsdp" / "checkpoint-2", resumed_dir / "checkpoint-2")
    cfg = _a_only(tmp, "fsdp_resumed", "fsdp", resume_from_checkpoint="latest")
    rows = _train(tmp, cfg, "fsdp_resumed")
    # metrics.jsonl is appended from the checkpoint's step: the resumed steps 2 and 3
    resumed = {r["step"]: r for r in rows}
    for original in fsdp_and_ddp["fsdp"][2:]:
        again = resumed[original["step"]]
        assert again["loss"] == original["loss"] and again["grad_norm"] == original["grad_norm"]
    a = load_file(str(tmp / "fsdp" / "checkpoint-4" / "model" / "model.safetensors"))
    b = load_file(str(resumed_dir / "checkpoint-4" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_ddp_run_resumes_an_fsdp_checkpoint(fsdp_and_ddp: dict) -> None:
    """The other direction is allowed (an fsdp run refuses a ddp checkpoint, which has no sharded state): DCP
    loads fsdp's sharded masters and AdamW state into the replicated model, and the resumed steps train what
    the fsdp run trained, up to the reduction order (as fsdp against ddp above)."""
    tmp = fsdp_and_ddp["tmp"]
    resumed_dir = tmp / "ddp_from_fsdp"
    resumed_dir.mkdir()
    shutil.copytree(tmp / "fsdp" / "checkpoint-2", resumed_dir / "checkpoint-2")
    rows = _train(tmp, _a_only(tmp, "ddp_from_fsdp", "ddp", resume_from_checkpoint="latest"), "ddp_from_fsdp")
    resumed = {r["step"]: r for r in rows}
    for original in fsdp_and_ddp["fsdp"][2:]:
        again = resumed[original["step"]]
        assert again["loss"] == pytest.approx(original["loss"], rel=1e-4), original["step"]
        assert again["grad_norm"] == pytest.approx(original["grad_norm"], rel=1e-3)
    assert (resumed_dir / "checkpoint-4" / "optimizer.pt").is_file()  # saved as ddp from here on


def test_fsdp_model_dir_is_plain_transformers_and_equals_the_sharded_masters(fsdp_and_ddp: dict) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForImageTextToText

    ckpt = fsdp_and_ddp["tmp"] / "fsdp" / "checkpoint-4"
    model = AutoModelForImageTextToText.from_pretrained(str(ckpt / "model"))
    consolidated = fsdp_and_ddp["tmp"] / "masters.pt"
    dcp_to_torch_save(str(ckpt / "train_state"), str(consolidated))
    masters = torch.load(consolidated, weights_only=False)["model"]
    loaded = model.state_dict()
    assert set(masters) == set(loaded)
    for name, tensor in masters.items():
        assert torch.equal(loaded[name], tensor), name


def test_example_fsdp_config_trains_syncs_from_shards_and_resumes(tmp_path: Path) -> None:
    """bf16 mixed precision + checkpointing + freeze_vit under fsdp, async Channel-B from an external
    server: the server ends up serving exactly the weights of the last checkpoint's model/."""
    out = tmp_path / "run"
    # the external server in this process (the same app as `stagectl rollout-server`, one process fewer)
    sets = ["model.torch_dtype=bfloat16", f"rollout_server.image_roots=[{Path.home()}]"]
    with in_process_server("builtin:tiny-qwen2.5-vl", *sets) as url:
        common = external_server_overrides(out, url)
        first = run_cli("train-ab", "examples/tiny/train_ab_fsdp.yaml", *common, timeout=500)
        assert first.returncode == 0, first.stderr[-4000:]
        resumed = run_cli(
            "train-ab",
            "examples/tiny/train_ab_fsdp.yaml",
            *common,
            "--set",
            "training.max_steps=10",
            "--set",
            "training.resume_from_checkpoint=latest",
            timeout=500,
        )
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        served = greedy_ids(url)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(10))
    assert any(r["kind"] == "B" for r in rows)
    synced = [r for r in rows if "weight_sync/bytes" in r]
    assert synced and all(r["weight_sync/state_bytes"] < 3_000_000 for r in synced)  # bf16: ~2.4 MB
    # float32 masters under bf16 compute move most trainable elements on every step, the first resumed one
    # too: the first run's cosine ended at 0 on step 8, and the resumed run (max_steps 10) trains step 8 at
    # its own schedule's lr, not at the 0 the optimizer saved
    moved = [r["optim/update_nonzero_frac"] for r in rows]
    assert len(moved) == 10 and min(moved) > 0.5, moved

    final = out / "checkpoint-8"
    assert {t.dtype for t in load_file(str(final / "model" / "model.safetensors")).values()} == {
        torch.bfloat16
    }
    # loaded back under the model's own parameter names (the file holds the checkpoint format's: `visual.*`)
    from transformers import AutoModelForImageTextToText

    saved = AutoModelForImageTextToText.from_pretrained(str(final / "model")).state_dict()
    base = base_state()
    tower = [n for n in saved if n.startswith("model.visual.") and ".merger." not in n]
    assert len(tower) > 10
    for name in tower:
        assert torch.equal(saved[name], base[name].to(torch.bfloat16)), f"frozen {name} moved"
    assert not torch.equal(saved["lm_head.weight"], base["lm_head.weight"].to(torch.bfloat16))

    # the server's weights are the ones pushed after step 10; a server started on the checkpoint's
    # model/ at step 10 (written from the same shards) answers the same greedy ids
    with in_process_server(
        str(out / "checkpoint-10" / "model")
    ) as reference:  # in this process: no second server start-up
        assert greedy_ids(reference) == served
