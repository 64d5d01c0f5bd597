"""`training` and `launch` sections: the optimizer loop and how processes are started."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from stagectl.config.base import StrictModel
from stagectl.config.dtypes import MixedPrecision
from stagectl.config.reporting import WandbConfig
from stagectl.config.user_path import UserPath


class KernelsConfig(StrictModel):
    """Faster paths of the learner's forward/backward, each off by default (the eager path) and each tested
    equal to it on the CPU (loss and gradients within float tolerance). Measured on a GPU by
    `python -m bench gpu` (BENCHMARKS.md, GPU)."""

    fused_linear_cross_entropy: bool = False
    """Apply the LM head inside the loss, in chunks of rows (`stagectl.models.linear_ce`): the weighted CE
    never builds the (loss rows x vocabulary) float32 logits and their gradient at once; the coordinate
    slots' logits are still formed for the box terms. Same matmul FLOPs; less memory and fewer elementwise
    passes. Not with `parallelism: fsdp`."""
    packed_attention: Literal["mask", "varlen"] = "mask"
    """How the language model attends within a pack. `mask`: the model's own implementation
    (`model.attn_implementation`) with transformers' block-diagonal causal mask. `varlen`: one
    variable-length causal attention call per layer over the pack's segments (PyTorch's flash
    `varlen_attn` on CUDA in bf16/fp16, else one causal `scaled_dot_product_attention` per distinct
    segment length), which skips the masked-out blocks; batches that are not packs (padded eval batches,
    cached decoding) keep the mask path. Needs `model.attn_implementation` sdpa or unset."""
    compile_blocks: bool = False
    """`torch.compile` each decoder layer of the language model and each block of the vision tower
    (in place: parameter names and checkpoints are unchanged). The first steps pay the compilation."""
    liger: bool = False
    """liger-kernel's fused RMSNorm, SwiGLU and rotary kernels patched into the model (the `liger` extra;
    triton kernels: CUDA only). Refused at start-up where liger-kernel does not import or the learner is
    not on CUDA."""


class TrainingConfig(StrictModel):
    per_device_train_batch_size: int = Field(1, ge=1)
    """Micro-batch size per rank. With `packing: true` it counts packed sequences and must be 1 (a
    micro-batch is one sequence filled toward `global_max_length`; raise `gradient_accumulation_steps`
    for more per step). With `packing: false` it counts samples (a right-padded batch)."""
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    """Micro-steps per optimizer step (GAS). Derived from `effective_batch_size` when unset; default 1."""
    effective_batch_size: int | None = Field(None, ge=1)
    """Micro-batch rows per optimizer step across all ranks; must equal per_device x world_size x GAS. With
    `packing: true` a row is one packed sequence of several samples (HF's samples per step is not this)."""
    learning_rate: float = Field(1e-4, gt=0)
    """Peak AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup length in optimizer steps."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the decay as a fraction of `learning_rate`."""
    max_steps: int = Field(20, ge=1)
    """Number of optimizer steps (updates, not micro-steps)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm; null disables clipping."""
    mixed_precision: MixedPrecision = "no"
    """Compute dtype of forward/backward. Master weights and AdamW state stay float32 whatever this is;
    `bf16` / `fp16` compute in that dtype (autocast under ddp, FSDP2's `MixedPrecisionPolicy` under fsdp)
    and reduce gradients in float32; `fp16` adds a dynamic loss scaler. `model.torch_dtype` is then the
    *storage* dtype: checkpoints' `model/` and the weights sent to rollout servers are converted to it at
    the edge. Use `bf16` on GPUs."""
    allow_low_precision_params: bool = False
    """Train the parameters in `model.torch_dtype` itself (bf16/fp16 parameters and AdamW state, no float32
    master copy). Off by default because AdamW steps at fine-tuning learning rates are smaller than bf16's
    spacing and are rounded away (watch `optim/update_nonzero_frac`); set it only to reproduce such a run."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """`ddp`: every rank holds the whole model, gradients and AdamW state. `fsdp`: PyTorch FSDP2
    (`fully_shard` per transformer block of the language model and the vision tower, then the root):
    parameters, gradients and optimizer state sharded over the ranks; checkpoints are sharded
    (torch.distributed.checkpoint) with `model/` still one plain Hugging Face directory."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass (language model and vision
    tower): activation memory per block drops to its inputs, at about one extra forward of compute."""
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    """Fused kernels, varlen attention and `torch.compile` for the forward/backward (all off by default)."""
    packing: bool = True
    """Pack segments into sequences of up to `global_max_length` tokens (position ids restart per
    segment, so packed logits equal unpacked ones): each micro-batch is one packed sequence."""
    packing_min_fill_ratio: float = Field(0.9, gt=0, le=1)
    """Target fill of a packed sequence (tokens / `global_max_length`). Channel-A packs from a look-ahead
    buffer and reaches it whenever the buffered samples allow; an async Channel-B ready pack is emitted
    once its rollouts reach it (earlier only when the policy version moves or the wait runs out)."""
    packing_buffer: int = Field(256, ge=1)
    """Look-ahead buffer of Channel-A samples per rank that packs are chosen from (more: fuller packs)."""
    seed: int = 0
    """Seed for model init, sampling, shuffling and rollout seeds (rollout seed = f(seed, step))."""
    output_dir: UserPath = Path("runs/train_ab")
    """Run directory: resolved config, metrics.jsonl, checkpoints."""
    logging_steps: int = Field(1, ge=1)
    """Console progress refresh period in optimizer steps (metrics.jsonl gets every step)."""
    save_steps: int = Field(0, ge=0)
    """Save a checkpoint every N optimizer steps (0 = only at the end)."""
    save_total_limit: int | None = Field(None, ge=1)
    """Keep at most this many step checkpoints (oldest removed first); null keeps all."""
    resume_from_checkpoint: UserPath | Literal["latest"] | None = None
    """A checkpoint directory to resume from, or `latest` for the newest one in `output_dir` (`--resume`;
    with no checkpoint there yet, `latest` starts a new run). Continues the run in `output_dir`:
    metrics.jsonl is appended, its rows after the checkpoint's step replaced (docs/run_directories.md).
    The learning rate follows this run's schedule keys (`learning_rate`, `max_steps`, `warmup_steps`, ...)
    from the checkpoint's step on, the first resumed step included: a larger `max_steps` extends the schedule."""
    overwrite_output_dir: bool = False
    """Start a new run even though `output_dir` holds one (`--overwrite`): the old run is moved aside to
    `{output_dir}.replaced-<time>`. Without it (or `resume_from_checkpoint`) such a start is refused."""
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    """Extra metric sinks besides metrics.jsonl: `tensorboard` (the `tensorboard` extra) and `wandb`
    (the `wandb` extra; see `training.wandb`). Every metrics row goes to each of them. One name alone
    (`report_to: tensorboard`) and `none` are read as the Hugging Face Trainer reads them."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases run settings (used with `report_to: [wandb]`)."""

    @field_validator("report_to", mode="before")
    @classmethod
    def validate_report_to_spelling(cls, value: object) -> object:
        """HF's `report_to: tensorboard` (one name) and `none`: a list of that name, and no sink."""
        if value == "none":
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("resume_from_checkpoint", mode="before")
    @classmethod
    def validate_resume_spelling(cls, value: object) -> object:
        """HF's `resume_from_checkpoint: true` / `false` are `latest` / null here (a bool read as a path
        gave pydantic's union error, `lax-or-strict[...]`)."""
        if isinstance(value, bool):
            spelled = "latest (or pass --resume)" if value else "null (or leave it out)"
            raise ValueError(f"{str(value).lower()} is the Hugging Face Trainer's spelling; write {spelled}")
        return value

    def saves_checkpoint(self, step: int) -> bool:
        """Whether the run writes `checkpoint-{step}` when `step` optimizer steps are done: every `save_steps`
        and at `max_steps` (once, when both hold; a run a signal stops also saves where it stops). The
        learner's rule, and `stagectl doctor`'s count of the checkpoints a run writes."""
        return (self.save_steps > 0 and step % self.save_steps == 0) or step == self.max_steps

    @model_validator(mode="after")
    def validate_fused_head_not_sharded(self) -> TrainingConfig:
        if self.kernels.fused_linear_cross_entropy and self.parallelism == "fsdp":
            raise ValueError(
                "kernels.fused_linear_cross_entropy applies the LM head outside the model's forward, which "
                "FSDP2's sharded head does not allow here; use parallelism: ddp, or turn the key off"
            )
        return self


class WatchdogConfig(StrictModel):
    """Deadlines of the collective phases of a multi-rank run. A rank that stays in one phase past its
    deadline prints the phase, the collective it is in and its stacks, and exits non-zero; the launcher
    then ends every other rank. Defaults are sized for real GPUs (7B checkpoints on network storage);
    tests set short ones. The process group's own timeout is set above the longest deadline, so the
    watchdog, which names the phase, always fires first."""

    startup_s: float = Field(1800.0, gt=0)
    """Process-group rendezvous, model load on every rank and DDP construction."""
    step_s: float = Field(600.0, gt=0)
    """One phase of a training step (channel decision, feasibility gate, one micro-step's
    forward/backward with the gradient all-reduce, metrics reduction) or one Stage-B batch."""
    weight_sync_s: float = Field(900.0, gt=0)
    """An async weight sync: fence, push to every rollout server, version broadcast."""
    checkpoint_s: float = Field(1800.0, gt=0)
    """A checkpoint save (rank 0 writes while the other ranks wait)."""
    eval_s: float = Field(1800.0, gt=0)
    """A held-out eval (rank 0 decodes while the other ranks wait)."""
    shutdown_s: float = Field(120.0, gt=0)
    """Shutdown: prefetcher join, final barrier, process-group teardown."""

    @property
    def longest_s(self) -> float:
        return max(
            self.startup_s, self.step_s, self.weight_sync_s, self.checkpoint_s, self.eval_s, self.shutdown_s
        )


class LaunchConfig(StrictModel):
    nproc_per_node: int = Field(1, ge=1)
    """Learner processes on this node; > 1 re-launches under torchrun (the CLI `--nproc` overrides)."""
    nnodes: int = Field(1, ge=1)
    """Number of nodes (multi-node needs `rdzv_endpoint`); run the same command on every node."""
    master_port: int | None = Field(None, ge=1, le=65535)
    """Rendezvous port for single-node runs; null lets the rendezvous bind a free port itself (no race)."""
    rdzv_endpoint: str | None = None
    """`host:port` of the rendezvous for multi-node runs (the same on every node; one node hosts it)."""
    rdzv_id: str | None = None
    """Rendezvous id shared by the nodes of one multi-node run (default: derived from `rdzv_endpoint`, so
    every node computes the same id; on a scheduler set it to the job id). Single-node runs get a
    fresh random id."""
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    """Per-phase deadlines of multi-rank runs."""
    devices: list[int] | None = Field(None, min_length=1)
    """CUDA devices of this node's learner ranks (one per rank, `nproc_per_node` of them), set as their
    `CUDA_VISIBLE_DEVICES`; rank k uses the k-th. Ids as the launching process sees them. null: devices
    0 .. nproc_per_node-1."""
    cpus: list[int] | None = Field(None, min_length=1)
    """CPU ids of this node's learner ranks, split into contiguous, near-equal slices (one per local rank),
    each rank pinned to its slice (`sched_setaffinity`) with one torch thread per CPU. null: the host's
    CPUs that `rollout_server.cpus` does not use when that is set (and the server is on this node), else
    nothing is pinned."""
    prefetcher_cpus: Literal["server", "learner"] = "server"
    """Where each rank's async Channel-B prefetcher thread runs when the learner and the server are both pinned
    on this node: `server`: on the server's CPUs (its rollout requests, parsing, matching and collating
    are rollout-side work that would otherwise take CPU time from the rank's forward/backward);
    `learner`: on the rank's own CPUs."""
