"""Data checks: every line parses and every image exists, opens and has the size its line declares
(`data.file`, the loader's own checks: `stagectl.data.jsonl`; a file that is not there gets how to write
one), the box format is unambiguous (`data.box_format`), and the longest Channel-A sample fits `global_max_length`
(`data.longest_sample`, needs the tokenizer and image processor).

The longest-sample check encodes one prompt per distinct tuple of image sizes (a blank image of that
size gives the same number of vision tokens as the real one) and tokenises every answer: exact, and
seconds for COCO-sized sets where encoding every image would take most of an hour."""

from __future__ import annotations

from pathlib import Path

from stagectl.config.model_data import DataConfig
from stagectl.data.jsonl import WRITE_JSONL_HINT, DataError, load_jsonl_dataset, read_box_format
from stagectl.data.sample import DetectionSample
from stagectl.doctor.report import Check, fail, ok, skip, warn
from stagectl.files import cwd_note

DATA_FIX = (
    "fix or remove the lines named (every image path is relative to data.image_root or the JSONL's directory)"
)
NUM_SHOWN_ERRORS = 3  # bad lines named in a data line; the rest are counted


def missing_file_fix(key: str, path: Path) -> str:
    """The fix for a data file that is not there: how one is made, and where a relative path was looked for."""
    return f"point {key} at the file{cwd_note(path)}, or {WRITE_JSONL_HINT.format(out=path)}"


def _bad_lines(name: str, exc: DataError, key: str, path: Path) -> Check:
    """The first bad lines of a data file (`file:line: what`), and how many more there are; a file that is
    not there gets the fix that makes one."""
    if path.is_dir():
        return fail(name, f"{path}: is a directory, not a JSONL file", f"point {key} at the JSONL file in it")
    if not path.is_file():
        return fail(name, f"{path}: no such file", missing_file_fix(key, path))
    shown = exc.errors[:NUM_SHOWN_ERRORS]
    more = f" (and {exc.num_errors - len(shown)} more bad lines)" if exc.num_errors > len(shown) else ""
    return fail(name, "; ".join(shown) + more, DATA_FIX)


def load_samples(data: DataConfig) -> tuple[list[DetectionSample] | None, list[Check]]:
    """The training samples as train-ab reads them (images opened and verified, the first image's size
    compared with the line's width and height), or None and a fail line."""
    if data.synthetic is not None:
        from stagectl.data.synthetic import generate_synthetic

        syn = data.synthetic
        samples = generate_synthetic(syn.num_samples, syn.seed, **syn.generator_kwargs())
        return samples, [ok("data.file", f"synthetic shapes: {len(samples)} samples drawn (seed {syn.seed})")]
    assert data.train_jsonl is not None  # DataConfig: exactly one source
    try:
        samples = load_jsonl_dataset(
            data.train_jsonl, data.image_root, box_format=data.box_format, verify_images=True
        )
    except DataError as exc:
        return None, [_bad_lines("data.file", exc, "data.train_jsonl", data.train_jsonl)]
    num_images = len({path for s in samples for path in s.images})
    return samples, [
        ok(
            "data.file",
            f"{data.train_jsonl}: {len(samples)} samples, {num_images} images exist, open and have the "
            "lines' sizes",
        )
    ]


def check_eval_file(data: DataConfig) -> list[Check]:
    """The held-out split (`data.eval.jsonl`), read as train-ab's periodic eval reads it."""
    if data.eval is None or data.eval.jsonl is None:
        return []
    try:
        samples = load_jsonl_dataset(
            data.eval.jsonl, data.eval.image_root, box_format=data.box_format, verify_images=True
        )
    except DataError as exc:
        return [_bad_lines("data.eval_file", exc, "data.eval.jsonl", data.eval.jsonl)]
    return [ok("data.eval_file", f"{data.eval.jsonl}: {len(samples)} samples, every image opens")]


def check_box_format(data: DataConfig) -> list[Check]:
    """Whether the file's boxes can only be read one way, and that way is the configured one."""
    name = "data.box_format"
    if data.synthetic is not None:
        return [ok(name, "synthetic boxes are norm1000")]
    assert data.train_jsonl is not None
    if not data.train_jsonl.is_file():
        return [skip(name, f"{data.train_jsonl} not found (see data.file)")]
    configured = data.box_format
    reading = read_box_format(data.train_jsonl, data.image_root)
    detected = reading.detected
    if reading.num_fit_neither:  # "set box_format: X" would be wrong advice: X does not load them either
        return [
            fail(
                name,
                f"{reading.num_fit_neither} box(es) fit neither reading (not norm-1000 integers in 0..999, not "
                "inside their image in pixels): no box_format loads them",
                "fix or remove those lines (data.file names them), then check data.box_format again",
            )
        ]
    if not reading.num_boxes:  # `auto` would say norm1000, and "set box_format: norm1000" be wrong advice
        return [
            skip(
                name, f"{data.train_jsonl} has no box to read (no objects, or no line parses: see data.file)"
            )
        ]
    if detected is None and reading.scale_1000:  # integers up to 1000: pixels, or a 0..1000 scale
        rescale = "a 0..1000 normalised scale must be rescaled to the norm-1000 bins 0..999"
        if configured == "pixel":
            return [
                warn(
                    name,
                    "every coordinate is an integer up to 1000: pixels, or a 0..1000 normalised scale; only "
                    "box_format: pixel decides",
                    f"make sure the boxes are pixels (as `stagectl convert coco` writes them); {rescale}",
                )
            ]
        return [
            fail(
                name,
                (reading.undecided or "")
                if configured == "auto"
                else "box_format is norm1000, but some coordinates are 1000, which is no norm-1000 bin (0..999): "
                "pixels, or a 0..1000 normalised scale",
                f"set data.box_format: pixel if they are pixels; {rescale}",
            )
        ]
    if detected is None:
        if configured == "auto":
            return [
                fail(
                    name,
                    reading.undecided or "box_format auto cannot tell",
                    "set data.box_format: pixel or norm1000",
                )
            ]
        return [
            warn(
                name,
                f"every box also fits the other reading; only box_format: {configured} decides",
                f"make sure the file's boxes are {configured} (`stagectl convert coco` writes pixel boxes, "
                "`stagectl demo-data` norm1000)",
            )
        ]
    if configured == "auto":
        return [ok(name, f"auto reads the boxes as {detected}, unambiguously")]
    if detected != configured:
        return [
            fail(
                name,
                f"box_format is {configured}, but some boxes only fit the {detected} reading",
                f"set data.box_format: {detected}",
            )
        ]
    return [ok(name, f"boxes are {configured}, unambiguously")]


def sample_lengths(bundle: object, samples: list[DetectionSample]) -> list[int]:
    """Tokens of every sample's Channel-A segment (prompt + GT answer + end of turn), as
    `learner.segments.SampleEncoder.channel_a_length` counts them."""
    from PIL import Image

    from stagectl.detection.targets import build_channel_a_segment
    from stagectl.detection.vocab import TokenVocab
    from stagectl.models.chat import encode_answer_text, encode_prompt
    from stagectl.models.loading import ModelBundle

    assert isinstance(bundle, ModelBundle)
    tokenizer = bundle.tokenizer
    processor = bundle.require_image_processor()
    vocab = TokenVocab.from_tokenizer(tokenizer)
    prompt_lengths: dict[tuple[tuple[int, int], ...], int] = {}
    lengths = []
    for sample in samples:
        sizes = tuple(_image_size(path) for path in sample.images)
        if sizes not in prompt_lengths:
            blanks = [Image.new("RGB", size) for size in sizes]
            prompt_lengths[sizes] = len(encode_prompt(tokenizer, processor, blanks).input_ids)
        target = build_channel_a_segment(
            sample.objects, encode=lambda text: encode_answer_text(tokenizer, text), vocab=vocab
        )
        lengths.append(prompt_lengths[sizes] + len(target.input_ids))
    return lengths


def _image_size(path: str) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:  # reads the header only
        return image.size


def check_longest_sample(global_max_length: int, lengths: list[int]) -> list[Check]:
    name = "data.longest_sample"
    limit = global_max_length
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    if too_long:
        return [
            fail(
                name,
                f"{len(too_long)} of {len(lengths)} samples exceed global_max_length {limit} (sample "
                f"{longest} has {lengths[longest]} tokens); train-ab stops at the first one it draws",
                f"set global_max_length >= {lengths[longest]}, or drop or shrink those samples "
                "(fewer objects, smaller images)",
            )
        ]
    return [ok(name, f"the longest sample (index {longest}) has {lengths[longest]} tokens of {limit}")]
