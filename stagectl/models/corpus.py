"""The built-in text the tiny tokenizer is trained on, and the fixed detection instruction.

Pure Python, no randomness: the corpus (and therefore the trained tokenizer) is identical on
every machine. It covers what the tiny model reads and writes: detection answers in the
assistant JSON format, colour and shape words, the instruction, Stage-B verdict lines, digits and
punctuation.
"""

from __future__ import annotations

DETECTION_INSTRUCTION = (
    "Detect every object in the image. For each object give a short description and its bounding box. "
    'Answer in JSON: {"object_1": {"desc": "...", "bbox_2d": [x1, y1, x2, y2]}, ...}, or {} if there '
    "is no object."
)
SYSTEM_PROMPT = "You are a helpful assistant."

COLOURS = (
    "red", "green", "blue", "yellow", "orange", "purple", "pink", "brown",
    "black", "white", "gray", "grey", "cyan", "magenta", "teal", "navy",
)  # fmt: skip
SHAPES = (
    "circle", "square", "triangle", "rectangle", "ellipse", "star", "diamond",
    "hexagon", "pentagon", "cross", "ring", "oval", "box",
)  # fmt: skip
ENGLISH = (
    SYSTEM_PROMPT,
    DETECTION_INSTRUCTION,
    "Describe the image. What objects do you see? Where is the red circle?",
    "The image shows a small blue square on the left and a large green triangle on the right.",
    "There are no objects in this image.",
    "Verdict: pass",
    "Verdict: fail",
    "Reason: the label on the box is missing, so the check fails.",
    "Reason: every part is present and in the right place, so the check passes.",
    "You are a careful inspector. Judge the group of images under the mission guidance.",
    "Summary of image 1: a red part at the top left. Summary of image 2: a blue part at the bottom.",
    "Answer with exactly two lines: a verdict line and a reason line.",
    "Propose guidance operations as strict JSON: add, update, delete or merge a rule.",
    '{"operations": [{"op": "add", "text": "check the label", "evidence": ["g1::pass"]}]}',
    "the a an of in on at to is are was be and or for with from by this that it its as not no yes",
    "top bottom left right center middle above below near far small large big tiny one two three four",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 255 512 999 1000 x1 y1 x2 y2 width height image images object",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
)


def _coord(i: int) -> str:
    return f"<|coord_{i}|>"


def _answer(objects: list[tuple[str, tuple[int, int, int, int]]]) -> str:
    """One assistant line in the exact detection answer format (docs/design.md#data-and-the-answer-format)."""
    items = []
    for n, (desc, box) in enumerate(objects, start=1):
        coords = ", ".join(f'"{_coord(b)}"' for b in box)
        items.append(f'"object_{n}": {{"desc": "{desc}", "bbox_2d": [{coords}]}}')
    return "{" + ", ".join(items) + "}"


def detection_answers() -> list[str]:
    """Answers with 0..4 objects over every colour x shape pair, with deterministic boxes."""
    descs = [f"{c} {s}" for c in COLOURS for s in SHAPES]
    lines = ["{}"]
    for i in range(len(descs)):
        num_objects = 1 + i % 4
        objects = []
        for k in range(num_objects):
            j = (i * 7 + k * 13) % len(descs)
            x1, y1 = (i * 37 + k * 101) % 700, (i * 53 + k * 71) % 700
            objects.append((descs[j], (x1, y1, x1 + 50 + (i * 11) % 240, y1 + 60 + (k * 17) % 230)))
        lines.append(_answer(objects))
    return lines


def corpus() -> list[str]:
    """The full training corpus: English lines repeated so their words merge, then the answers."""
    return [*ENGLISH, *ENGLISH, *COLOURS, *SHAPES, *detection_answers()]
