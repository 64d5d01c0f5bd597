"""What rank 0 writes into a checkpoint, and the weight digest of a finished run.

`model_state_to_save` (every rank: FSDP2 gathers are collectives) gives the `model/` tensors in the storage
dtype — gathered from FSDP2 shards (each rank first writes its shards of the masters and AdamW state with
`torch.distributed.checkpoint`), merged from an adapter, or cast from the float32 masters — or None when
the model's own state dict is what `model/` holds. `write_checkpoint` (rank 0) hands everything to
`checkpoint.save_checkpoint`, which writes it atomically.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from stagectl import dist
from stagectl.learner import adapter, sharding
from stagectl.learner import checkpoint as ckpt
from stagectl.learner.setup import LearnerState


def model_state_to_save(
    st: LearnerState, step: int, *, is_main: bool
) -> tuple[dict[str, torch.Tensor] | None, Path | None]:
    """Every rank: `(model_state, sharded_dir)` for `write_checkpoint` (the state only on rank 0 under fsdp)."""
    model = st.bundle.model
    if sharding.is_sharded(model):
        import torch.distributed.checkpoint as dcp

        staging = ckpt.shards_staging_dir(st.plan.output_dir, step) if is_main else None
        sharded_dir = Path(dist.broadcast_object(str(staging)))
        dcp.save(sharding.sharded_state(model, st.optimizer), checkpoint_id=str(sharded_dir))
        return sharding.full_state_dict(model, dtype=st.precision.storage_dtype, keep=is_main), sharded_dir
    if adapter.has_adapter(model):
        # model/ holds the merged weights (what vLLM and transformers load); adapter/ the adapter
        return adapter.merged_state_dict(model, dtype=st.precision.storage_dtype), None
    if st.precision.storage_dtype != st.precision.param_dtype:
        state = {
            k: v.detach().to("cpu", dtype=st.precision.storage_dtype) for k, v in model.state_dict().items()
        }
        return state, None
    return None, None


def write_checkpoint(
    st: LearnerState,
    step: int,
    rng_states: list[dict[str, Any]],
    rank_states: list[dict[str, Any]],
    *,
    world_size: int,
    extra: dict[str, Any],
    async_states: list[Any] | None,
    model_state: dict[str, torch.Tensor] | None,
    sharded_dir: Path | None,
) -> None:
    """Rank 0: checkpoint-`step` with the processors (and adapter/), the optimizer (unless sharded), the
    scheduler, every rank's RNG state and stream positions, and `extra` in `trainer_state.json`."""
    # ddp with model/ in another dtype: the float32 masters are kept beside it for an exact resume
    # (with an adapter the base is model.name_or_path and adapter/ holds the trained tensors in float32)
    adapter_cfg = st.plan.model.adapter
    keep_masters = sharded_dir is None and model_state is not None and adapter_cfg is None

    def save_processors(path: Any) -> None:
        st.bundle.tokenizer.save_pretrained(path)
        if st.bundle.image_processor is not None:  # text-only models have none
            st.bundle.image_processor.save_pretrained(path)
        if adapter_cfg is not None:  # `path` is the checkpoint's model/: adapter/ goes beside it
            base = st.plan.model.name_or_path
            adapter.save_adapter(st.bundle.model, adapter_cfg, base, Path(path).parent / adapter.ADAPTER_DIR)

    ckpt.save_checkpoint(
        st.plan.output_dir,
        step,
        model=st.bundle.model,
        save_tokenizer=save_processors,
        optimizer=None if sharded_dir is not None else st.optimizer,
        model_state=model_state,
        master_state=st.bundle.model.state_dict() if keep_masters else None,
        sharded_dir=sharded_dir,
        scheduler=st.scheduler,
        rng_states=rng_states,
        trainer_state=ckpt.TrainerState(
            global_step=step,
            data_state={
                "world_size": world_size,
                "num_train_samples": len(st.encoder.samples),  # the stream positions index this set
                "ranks": rank_states,
            },
            extra=extra,
        ),
        total_limit=st.plan.training.save_total_limit,
        async_states=async_states,
    )


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every tensor's name and bytes, in state-dict order (the same on every rank; FSDP2 shards
    are gathered one tensor at a time, a collective every rank joins)."""
    h = hashlib.sha256()
    for name, tensor in sharding.full_tensors(model):
        h.update(name.encode())
        h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
