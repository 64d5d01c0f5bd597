"""`stagectl demo-data`: writing again into the same directory leaves exactly the new data set (no stale
images, no eval split not asked for); an OUT under a file is refused naming the file. In process."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from stagectl.cli.app import app


def demo_data(out: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["demo-data", str(out), "--image-size", "28", *args])
    return result.exit_code, result.output


def test_writing_fewer_samples_again_removes_what_the_first_run_wrote(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    assert demo_data(out, "--num-samples", "4", "--num-eval-samples", "3")[0] == 0
    (out / "images" / "mine.png").write_bytes(b"the user's")  # not demo-data's: left alone
    code, output = demo_data(out, "--num-samples", "2")
    assert code == 0, output
    assert "wrote 2 samples" in output
    assert sorted(p.name for p in (out / "images").iterdir()) == [
        "mine.png",
        "train_000000.png",
        "train_000001.png",
    ]
    assert sorted(p.name for p in out.iterdir()) == ["images", "train.jsonl", "train.manifest.json"]
    assert len((out / "train.jsonl").read_text().splitlines()) == 2


def test_one_sample_is_singular(tmp_path: Path) -> None:
    code, output = demo_data(tmp_path / "demo", "--num-samples", "1", "--max-objects", "1")
    assert code == 0 and "wrote 1 sample (1 object, 28px)" in output


def test_an_out_under_a_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    code, output = demo_data(tmp_path / "afile" / "demo", "--num-samples", "2")
    assert code == 1
    assert (
        f"error: OUT: cannot write to {tmp_path / 'afile' / 'demo'}: {tmp_path / 'afile'} is a file, not a directory"
        in output
    )
    assert "Errno" not in output


def test_a_train_jsonl_demo_data_did_not_write_is_refused_and_kept(tmp_path: Path) -> None:
    """ "Other files are left alone" did not hold for the user's own train.jsonl: it was replaced silently."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "train.jsonl").write_text('{"my": "own data"}\n')
    code, output = demo_data(out, "--num-samples", "2")
    assert code == 1
    assert f"error: OUT: {out / 'train.jsonl'} exists and no earlier demo-data wrote it" in output
    assert (out / "train.jsonl").read_text() == '{"my": "own data"}\n'
    assert sorted(p.name for p in out.iterdir()) == ["train.jsonl"]  # nothing written
