"""Named validators of how train-ab trains: precision, sharding, freezing (see `validators` for the
convention: one rule each, `Problem`s returned, never raised)."""

from __future__ import annotations

from stagectl.config.root import Problem, StagectlConfig, is_train_ab, uses_server_rollouts


def validate_precision(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    """AdamW on bf16/fp16 parameters loses most updates at fine-tuning learning rates: refused unless
    the user opts in; the opt-in must mean something."""
    if not is_train_ab(cfg):
        return []
    training, dtype = cfg.training, cfg.model.torch_dtype
    low = training.allow_low_precision_params
    if low and training.mixed_precision != "no":
        return [
            Problem(
                "training.allow_low_precision_params",
                f"trains the parameters in model.torch_dtype itself, which contradicts training.mixed_precision: "
                f"{training.mixed_precision} (float32 master weights); keep one of them",
            )
        ]
    if low and dtype == "float32":
        return [
            Problem(
                "training.allow_low_precision_params",
                "has no effect with model.torch_dtype: float32; set model.torch_dtype: bfloat16 to train bf16 "
                "parameters, or remove the key",
            )
        ]
    if dtype != "float32" and training.mixed_precision == "no" and not low:
        short = "bf16" if dtype == "bfloat16" else "fp16"
        return [
            Problem(
                "training.mixed_precision",
                f"model.torch_dtype: {dtype} is the storage dtype; train with training.mixed_precision: {short} "
                "(float32 master weights and optimizer state, compute in "
                f"{dtype}: what HF Trainer bf16=True, DeepSpeed and FSDP do). Training the {dtype} parameters "
                "directly rounds most AdamW updates away at fine-tuning learning rates (bfloat16 parameters of the "
                "tiny Qwen2.5-VL at lr 1e-5: 10% of elements change per step, 71% with float32 masters; "
                "docs/precision_and_sharding.md); if that is what you want, set "
                "training.allow_low_precision_params: true",
            )
        ]
    return []


def validate_parallelism(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    """fsdp shards over ranks and needs every rank to run the same forwards: Channel-B from a server."""
    training = cfg.training
    if not is_train_ab(cfg) or training.parallelism != "fsdp":
        return []
    problems = []
    if world_size < 2:
        problems.append(
            Problem(
                "training.parallelism",
                f"fsdp shards parameters over the learner ranks, but this run has {world_size}; run with "
                "--nproc 2 or more (launch.nproc_per_node), or use parallelism: ddp on one process",
            )
        )
    if training.mixed_precision == "fp16":
        problems.append(
            Problem(
                "training.mixed_precision",
                "fp16 (with its loss scaler) is supported under parallelism: ddp only; use bf16 under fsdp",
            )
        )
    ratio = cfg.stage2_ab.schedule.b_ratio if cfg.stage2_ab is not None else None
    a_only = ratio is not None and float(ratio) == 0.0
    if not a_only and not uses_server_rollouts(cfg):
        problems.append(
            Problem(
                "custom.extra.rollout_matching.rollout_backend",
                "parallelism: fsdp generates Channel-B rollouts on a rollout server (every rank must run the "
                "same forwards); set rollout_backend: vllm with vllm.mode: server and channel_b.mode: async",
            )
        )
    return problems


def validate_adapter(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    """`model.adapter` is trained by train-ab (ddp or one process) on a float32 master base."""
    if cfg.model.adapter is None:
        return []
    if not is_train_ab(cfg):
        if cfg.guidance is None:
            # like training.*, a learner key in a server config (the training YAML the server is started
            # from): with vllm.sync.mode: adapter the hf server merges synced adapters onto its base
            return []
        return [
            Problem(
                "model.adapter",
                "is trained by train-ab; Stage-B loads a plain model: point model.name_or_path at a "
                "train-ab checkpoint's merged model/ (or a `stagectl export` of it)",
            )
        ]
    training = cfg.training
    problems = []
    if training.parallelism == "fsdp":
        problems.append(
            Problem(
                "training.parallelism",
                "fsdp with model.adapter is not supported (the adapter is small: DDP replicates it cheaply); "
                "use parallelism: ddp",
            )
        )
    if training.allow_low_precision_params:
        problems.append(
            Problem(
                "training.allow_low_precision_params",
                "with model.adapter the frozen base is held in float32 like the adapter; a base held in "
                "model.torch_dtype is not supported yet; remove the key (use training.mixed_precision: bf16)",
            )
        )
    return problems


def validate_run_dir_choice(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    """Continuing the run in output_dir and moving it aside are opposite answers to the same question."""
    training = cfg.training
    if training.overwrite_output_dir and training.resume_from_checkpoint is not None:
        return [
            Problem(
                "training.overwrite_output_dir",
                "contradicts training.resume_from_checkpoint (continue the run in output_dir, or move it "
                "aside and start again: choose one; --resume and --overwrite set these keys)",
            )
        ]
    return []


def validate_kernels(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    """`packed_attention: varlen` swaps the language model's sdpa for one varlen call (sdpa is also its
    fallback): a model set to another attention would otherwise be refused only once it has loaded."""
    attention = cfg.model.attn_implementation
    if not is_train_ab(cfg):  # the learner's kernels: a server started from the same YAML does not use them
        return []
    if cfg.training.kernels.packed_attention == "varlen" and attention not in (None, "sdpa"):
        return [
            Problem(
                "training.kernels.packed_attention",
                f"varlen needs the language model on sdpa, but model.attn_implementation is {attention}; set "
                "model.attn_implementation: sdpa (or leave it unset), or packed_attention: mask",
            )
        ]
    return []
