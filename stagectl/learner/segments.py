"""From data samples to packable training segments: cached prompt encodings, Channel-A segments,
and the conversion of an assistant target (detection.targets) into a full `packing.Segment`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stagectl.data.sample import DetectionSample
from stagectl.detection.targets import Segment as TargetSegment
from stagectl.detection.targets import build_channel_a_segment
from stagectl.detection.vocab import TokenVocab
from stagectl.models.chat import EncodedSample, encode_answer_text, encode_prompt
from stagectl.models.generate import PromptInputs
from stagectl.models.images import open_rgb
from stagectl.models.loading import ModelBundle
from stagectl.packing import CoordGroup, Segment


@dataclass
class SampleEncoder:
    """Encodes prompts of a fixed data set once and keeps them (images are small and reused)."""

    bundle: ModelBundle
    samples: Sequence[DetectionSample]
    vocab: TokenVocab

    def __post_init__(self) -> None:
        self._prompts: dict[int, EncodedSample] = {}

    def prompt(self, index: int) -> EncodedSample:
        cached = self._prompts.get(index)
        if cached is None:
            sample = self.samples[index]
            images = [open_rgb(path) for path in sample.images]
            cached = encode_prompt(self.bundle.tokenizer, self.bundle.require_image_processor(), images)
            self._prompts[index] = cached
        return cached

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
