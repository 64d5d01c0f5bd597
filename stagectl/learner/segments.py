"""From data samples to packable training segments: cached prompt encodings, Channel-A segments,
and the conversion of an assistant target (detection.targets) into a full `collate.Segment`."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from stagectl.collate import CoordGroup, Segment
from stagectl.data.sample import DetectionSample
from stagectl.detection.targets import Segment as TargetSegment
from stagectl.detection.targets import build_channel_a_segment
from stagectl.detection.vocab import TokenVocab
from stagectl.models.chat import EncodedSample, encode_answer_text, encode_prompt
from stagectl.models.generate import PromptInputs
from stagectl.models.images import open_rgb
from stagectl.models.loading import ModelBundle

PROMPT_CACHE_SIZE = 256  # encoded prompts kept (pixel values of a real image are tens of MB)


@dataclass
class SampleEncoder:
    """Encodes the prompts of a fixed data set, keeping the most recent `PROMPT_CACHE_SIZE` (a look-ahead
    packing buffer and the rollouts that follow reuse them) and every Channel-A segment's length (what
    packing needs to plan, a few bytes a sample). Thread-safe: the prefetcher encodes too."""

    bundle: ModelBundle
    samples: Sequence[DetectionSample]
    vocab: TokenVocab

    def __post_init__(self) -> None:
        self._prompts: OrderedDict[int, EncodedSample] = OrderedDict()
        self._a_lengths: dict[int, int] = {}
        self._lock = threading.Lock()

    def prompt(self, index: int) -> EncodedSample:
        with self._lock:
            cached = self._prompts.get(index)
            if cached is not None:
                self._prompts.move_to_end(index)
                return cached
        sample = self.samples[index]
        images = [open_rgb(path) for path in sample.images]
        encoded = encode_prompt(self.bundle.tokenizer, self.bundle.require_image_processor(), images)
        with self._lock:
            self._prompts[index] = encoded
            while len(self._prompts) > PROMPT_CACHE_SIZE:
                self._prompts.popitem(last=False)
        return encoded

    @property
    def pad_token_id(self) -> int:
        """What padded batches and left-padded prompts are padded with (0 when the tokenizer has none)."""
        pad = self.bundle.tokenizer.pad_token_id
        return int(pad) if pad is not None else 0

    def channel_a_length(self, index: int) -> int:
        """Tokens of sample `index`'s Channel-A segment (prompt + GT answer), computed once."""
        length = self._a_lengths.get(index)
        if length is None:
            length = len(self.channel_a_segment(index))
            self._a_lengths[index] = length
        return length

    def prompt_inputs(self, index: int) -> PromptInputs:
        p = self.prompt(index)
        return PromptInputs(p.input_ids, p.mm_token_type_ids, p.pixel_values, p.image_grid_thw)

    def encode_text(self, text: str) -> list[int]:
        return encode_answer_text(self.bundle.tokenizer, text)

    def channel_a_segment(self, index: int) -> Segment:
        target = build_channel_a_segment(
            self.samples[index].objects, encode=self.encode_text, vocab=self.vocab
        )
        return to_segment(self.prompt(index), target)


def to_segment(prompt: EncodedSample, target: TargetSegment) -> Segment:
    """Prompt (CE off) + assistant target, with coordinate positions moved past the prompt."""
    offset = len(prompt.input_ids)
    return Segment(
        input_ids=[*prompt.input_ids, *target.input_ids],
        ce_weights=[0.0] * offset + list(target.ce_weights),
        mm_token_type_ids=[*prompt.mm_token_type_ids, *([0] * len(target.input_ids))],
        pixel_values=prompt.pixel_values,
        image_grid_thw=prompt.image_grid_thw,
        coord_groups=[
            CoordGroup(
                (
                    g.positions[0] + offset,
                    g.positions[1] + offset,
                    g.positions[2] + offset,
                    g.positions[3] + offset,
                ),
                g.gt_bins,
            )
            for g in target.coord_groups
        ],
    )
