"""The docs table (docs/memory.md): the per-rank estimate of the reference checkpoints on 8 x 80 GB, ddp
vs fsdp, with and without gradient checkpointing and `freeze_vit`, bf16 mixed precision, 4096 tokens per
micro-batch, flash_attention_2. `python -m stagectl.memory.table` prints it; a unit test keeps
docs/memory.md equal to it."""

from __future__ import annotations

from dataclasses import replace

from stagectl.memory.estimate import GIB, TrainingKnobs, estimate_memory
from stagectl.memory.reference import REFERENCE_CONFIGS
from stagectl.memory.shapes import shape_from_hf_config

TABLE_KNOBS = TrainingKnobs(world_size=8, mixed_precision="bf16", global_max_length=4096)
CARD_GIB = 80
USABLE_FRACTION = 0.9  # the rest: CUDA context, NCCL buffers, allocator fragmentation


def reference_table(knobs: TrainingKnobs = TABLE_KNOBS) -> list[str]:
    """Markdown lines: one row per model x parallelism x checkpointing x freeze_vit, GiB per rank."""
    lines = [
        "| model | parallelism | checkpointing | freeze_vit | weights | grads | optimizer | activations | logits "
        f"| buffers | **total** | fits {CARD_GIB} GB |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, config in REFERENCE_CONFIGS.items():
        shape = shape_from_hf_config(config)
        for parallelism in ("ddp", "fsdp"):
            for checkpointing in (False, True):
                for freeze_vit in (False, True):
                    row = replace(
                        knobs,
                        parallelism=parallelism,
                        gradient_checkpointing=checkpointing,
                        freeze_vit=freeze_vit,
                    )
                    e = estimate_memory(shape, row)
                    cells = " | ".join(f"{v / GIB:.1f}" for v in (e.weights, e.grads, e.optimizer))
                    cells += " | " + " | ".join(
                        f"{v / GIB:.1f}" for v in (e.activations, e.logits, e.buffers)
                    )
                    fits = "yes" if e.total <= USABLE_FRACTION * CARD_GIB * GIB else "no"
                    lines.append(
                        f"| {name} | {parallelism} | {'yes' if checkpointing else 'no'} | "
                        f"{'yes' if freeze_vit else 'no'} | {cells} | **{e.total / GIB:.1f}** | {fits} |"
                    )
    return lines


if __name__ == "__main__":
    print("\n".join(reference_table()))
