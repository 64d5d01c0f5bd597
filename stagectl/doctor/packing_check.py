"""`packing.forward`: a packed forward equals the unpacked forwards for a real pack of the user's data.

The pack is chosen as Channel-A chooses one (`stagectl.packing.select_pack` over the first samples, toward
`global_max_length`) and built by the product's own `SampleEncoder` and `collate.collate_pack`; each
segment is then run alone through `collate.collate_padded` (no position ids: the model computes its own).
Logits must agree within `RTOL` of the largest logit: a pack whose position ids do not restart per segment
(the silent bug class of packed VLM trainers) lets segments attend to each other and misses by orders of
magnitude more. Float32 compute, whatever `training.mixed_precision` is: the check is about packing, and
bf16 rounding would hide a small leak."""

from __future__ import annotations

from stagectl import collate
from stagectl.config.training import TrainingConfig
from stagectl.data.sample import DetectionSample
from stagectl.doctor.report import Check, fail, ok, warn
from stagectl.models.loading import ModelBundle
from stagectl.packing import select_pack

RTOL = 1e-3  # of max |logit|; float32 sdpa packs agree to ~1e-6 of it on the tiny models
LOOKAHEAD = 64  # samples the pack is chosen from (Channel-A's buffer holds training.packing_buffer)


def check_packed_forward(
    global_max_length: int,
    training: TrainingConfig,
    bundle: ModelBundle,
    samples: list[DetectionSample],
    lengths: list[int],
) -> Check:
    import torch

    from stagectl.detection.vocab import TokenVocab
    from stagectl.learner.segments import SampleEncoder

    name = "packing.forward"
    limit = global_max_length
    fitting = [i for i in range(len(samples)) if lengths[i] <= limit][
        : min(LOOKAHEAD, training.packing_buffer)
    ]
    if not fitting:
        return fail(name, "no sample fits global_max_length", "see data.longest_sample")
    chosen = [fitting[k] for k in select_pack([lengths[i] for i in fitting], limit)]
    encoder = SampleEncoder(bundle=bundle, samples=samples, vocab=TokenVocab.from_tokenizer(bundle.tokenizer))
    segments = [encoder.channel_a_segment(i) for i in chosen]
    model = bundle.model
    device = next(model.parameters()).device
    try:
        batch = collate.collate_pack(segments, model).to(device)
    except ValueError as exc:  # a model family whose packed positions stagectl cannot build
        return fail(name, str(exc), "train-ab trains Qwen-VL models (model.name_or_path)")
    with torch.no_grad():
        packed = model(**batch.model_inputs()).logits[0].float()  # (L, V)
        worst, scale = 0.0, 0.0
        for segment, start in zip(segments, batch.segment_starts, strict=True):
            alone = collate.collate_padded([segment], encoder.pad_token_id).to(device)
            single = model(**alone.model_inputs()).logits[0].float()  # (T, V)
            diff = (packed[start : start + len(segment)] - single).abs().max().item()
            worst = max(worst, diff)
            scale = max(scale, single.abs().max().item())
    tolerance = RTOL * max(scale, 1.0)
    what = f"{len(segments)} samples, {batch.num_tokens} of {limit} tokens"
    if worst > tolerance:
        message = (
            f"packed logits differ from unpacked ones by {worst:.3g} (> {tolerance:.3g}) on a pack of {what}: "
            "segments leak into each other (position ids that do not restart, or an attention kernel that "
            "ignores them)"
        )
        if not training.packing:
            return warn(name, message, "training.packing is false, so training is unaffected; keep it off")
        return fail(
            name,
            message,
            "set training.packing: false (padded micro-batches) and report the model type and transformers version",
        )
    return ok(
        name, f"packed = unpacked logits within {worst:.2g} (tolerance {tolerance:.2g}) on a pack of {what}"
    )
