"""The docs say what the code is: the generated command and config reference equals what
`python -m stagectl.cli.docgen` writes now, and no tracked file points at a repository file that is not there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from stagectl.cli import docgen

REPO = Path(__file__).parents[2]


@pytest.mark.parametrize("rel", sorted(docgen.generated_files()))
def test_committed_reference_equals_the_generated_one(rel: str) -> None:
    committed = (REPO / rel).read_text(encoding="utf-8") if (REPO / rel).is_file() else ""
    generated = docgen.generated_files()[rel]
    assert committed == generated, (
        f"{rel} is stale: run `python -m stagectl.cli.docgen` and commit the result"
    )


def test_reference_names_every_option_and_key() -> None:
    """The generator walks the whole app and the whole schema (a flag or key it skipped would never go stale)."""
    import typer

    from stagectl.cli.app import app
    from stagectl.config import StagectlConfig

    cli = docgen.cli_reference()
    root: Any = typer.main.get_command(app)
    for command in root.commands.values():
        for sub in getattr(command, "commands", {"": command}).values():
            for param in sub.params:
                if getattr(param, "hidden", False):  # stagectl's own (train-ab's --plan for its ranks)
                    assert f"`{param.opts[0]}`" not in cli, param.opts[0]
                    continue
                for opt in param.opts if param.param_type_name == "option" else [param.name.upper()]:
                    assert f"`{opt}`" in cli, opt
    config = docgen.config_reference()
    for key in ("training.max_steps", "stage2_ab.channel_b.async.queue_limit", "rollout_server.image_roots"):
        assert f"`{key}`" in config, key
    assert "`stage2_ab.schedule.pattern`" in config  # removed keys and their migration messages
    assert len(re.findall(r"^\| `", config, flags=re.M)) >= len(StagectlConfig.model_fields)


def test_a_section_a_parent_builds_with_other_values_shows_those_defaults() -> None:
    """`data.eval.decoding` is a `DecodingConfig` built greedy (temperature 0.0) where the class's own default
    is Channel-B's 0.01: the reference gives the value a config gets (it gave 0.01)."""
    from stagectl.config.model_data import EvalDataConfig

    config = docgen.config_reference()
    row = next(
        line for line in config.splitlines() if line.startswith("| `data.eval.decoding.temperature` |")
    )
    assert row.split(" | ")[2] == f"`{EvalDataConfig().decoding.temperature}`" == "`0.0`"
    channel_b = next(
        line
        for line in config.splitlines()
        if line.startswith("| `custom.extra.rollout_matching.decoding.temperature` |")
    )
    assert channel_b.split(" | ")[2] == "`0.01`"


# ---------------------------------------------------------------- references to repository files

# A link `[text](path)`, or a path with a directory part, or an upper-case bare name (`DESIGN.md`), ending in
# one of the extensions the repository's own docs, code and configs use; a `.md` may name a section
# (`docs/design.md#strict-parse`), which must then be one of its headings.
EXT = r"\.(?:md|py|ya?ml)"
LINK = re.compile(r"\]\(([^)\s#]+" + EXT + r")(?:#([^)\s]*))?\)")
PATH = re.compile(
    r"(?<![\w/.~${}<*-])((?:\.{1,2}/)?(?:[\w.-]+/)+[\w.-]+"
    + EXT
    + r"|[A-Z][A-Z_]+\.md)(?:#([\w-]+))?(?![\w/])"
)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
TEXT_SUFFIXES = {".md", ".py", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini"}
# Files stagectl writes at run time, named in docs as outputs (they are not repository files).
RUN_TIME_NAMES = {"README.md"}


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=30
        ).stdout.decode()
        rels = [r for r in out.split("\0") if r]
    except (OSError, subprocess.CalledProcessError):  # an sdist without git: every file under the tree
        rels = [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [REPO / r for r in rels if Path(r).suffix in TEXT_SUFFIXES or Path(r).name == "Makefile"]


def prose_of(path: Path) -> str:
    """The file's text. Code is scanned too: identifiers and expressions never look like `dir/name.md`,
    and a whole-text scan costs a fraction of parsing every module for its strings and comments."""
    return path.read_text(encoding="utf-8", errors="replace")


def anchors_of(markdown: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`, repeats
    numbered (`-1`, `-2`); headings inside code fences do not count."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", markdown.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def missing_references(path: Path) -> list[str]:
    """Links, and paths whose first directory is one of the repository's (`docs/...`, `examples/...`,
    `engines/hf.py` next to the file), that name no file or no section of it; `RUN_DIR/report.md`,
    `swift/...` (another project) or `path/to.yaml` start elsewhere and are not repository references."""
    prose = prose_of(path)
    links = {ref for ref, _ in LINK.findall(prose)}
    missing = []
    bases = [path.parent, REPO, REPO / "stagectl", REPO / "tests"]
    for ref, anchor in sorted(set(LINK.findall(prose)) | set(PATH.findall(prose))):
        if ref in RUN_TIME_NAMES or ref.startswith(("http", "/")):
            continue
        top = ref.split("/")[0]
        names_repo_dir = "/" not in ref or top in (".", "..") or any((b / top).is_dir() for b in bases)
        if not ((ref in links and path.suffix == ".md") or names_repo_dir):
            continue
        target = next((base / ref for base in bases if (base / ref).exists()), None)
        if target is None:
            missing.append(ref)
        elif anchor and target.suffix == ".md" and anchor not in anchors_of(target):
            missing.append(f"{ref}#{anchor}")
    return sorted(set(missing))


def test_no_reference_to_a_file_that_is_not_in_the_repository() -> None:
    this_file = Path(__file__).resolve()  # its own examples below name missing files on purpose
    problems = [
        f"{path.relative_to(REPO)}: {ref}"
        for path in tracked_text_files()
        if path.resolve() != this_file
        for ref in missing_references(path)
    ]
    assert not problems, "references to files not in the repository:\n" + "\n".join(problems)


def test_the_reference_scan_catches_a_missing_file(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n## The `/infer/` call\n\nSee [the design](DESIGN.md#parse), docs/nowhere.md and"
        " `examples/tiny/gone.yaml`; [no such section](page.md#nowhere). README.md, [ok](page.md),"
        " [a section](page.md#the-infer-call) and https://x.org/a.md are fine.\n"
    )
    assert missing_references(page) == [
        "DESIGN.md",
        "docs/nowhere.md",
        "examples/tiny/gone.yaml",
        "page.md#nowhere",
    ]
    module = tmp_path / "m.py"
    module.write_text('"""Rules (DESIGN.md section 5)."""\nx = 1  # see docs/gone.md\npath = a / "b.py"\n')
    assert missing_references(module) == ["DESIGN.md", "docs/gone.md"]


def test_docgen_help_and_unknown_arguments_write_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:

    def no_write() -> dict[str, str]:
        raise AssertionError("the reference files were generated")

    monkeypatch.setattr(docgen, "generated_files", no_write)
    assert docgen.main(["--help"]) == 0
    assert "--check" in capsys.readouterr().out
    assert docgen.main(["--chek"]) == 2
    assert "unknown argument(s): --chek" in capsys.readouterr().err
