"""Everything a learner run needs before its first step: world, model, data, samplers, optimizer,
resume state, metrics sink. Kept apart from the loop so the loop reads top to bottom."""

from __future__ import annotations

import contextlib
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stagectl import dist
from stagectl.config.model_data import DataConfig
from stagectl.config.plan import PLAN_FILE
from stagectl.config.plan_train import TrainPlan, write_train_plan
from stagectl.config.root import Resolved
from stagectl.config.training import TrainingConfig
from stagectl.console import say
from stagectl.data.jsonl import load_jsonl_dataset
from stagectl.data.sample import DetectionSample
from stagectl.data.sampler import ShardedSampler
from stagectl.data.synthetic import generate_synthetic
from stagectl.detection.vocab import TokenVocab
from stagectl.dist import World, device_for, init_distributed
from stagectl.files import check_output_dir, write_resolved_config
from stagectl.learner import adapter, sharding
from stagectl.learner import checkpoint as ckpt
from stagectl.learner.optim import build_optimizer
from stagectl.learner.parts import FreezeReport, freeze_parts
from stagectl.learner.precision import Precision
from stagectl.learner.segments import SampleEncoder
from stagectl.models.capability import detection_model_problem
from stagectl.models.loading import ModelBundle, load_bundle, resolve_model_path
from stagectl.models.speedups import apply_speedups
from stagectl.rundir.liveness import mark_running
from stagectl.rundir.policy import prepare_train_dir
from stagectl.rundir.resume import record_resume, resume_note


@dataclass
class LearnerState:
    plan: TrainPlan
    resolved: Resolved
    world: World
    device: torch.device
    bundle: ModelBundle
    ddp_model: Any  # DistributedDataParallel, or the model itself (one rank, or sharded in place by FSDP2)
    precision: Precision
    grad_scaler: torch.amp.GradScaler | None  # fp16 compute only
    freeze: FreezeReport
    encoder: SampleEncoder
    a_sampler: ShardedSampler
    b_sampler: ShardedSampler
    optimizer: torch.optim.Optimizer
    scheduler: Any
    coord_token_ids: torch.Tensor  # (1000,)
    start_step: int
    resumed_from: Path | None
    extra_state: dict[str, Any]


def load_train_samples(data: DataConfig) -> list[DetectionSample]:
    if data.synthetic is not None:
        syn = data.synthetic
        return generate_synthetic(syn.num_samples, syn.seed, **syn.generator_kwargs())
    assert data.train_jsonl is not None
    # verify_images: a corrupt image fails here as `file:line`, not on whichever rank draws it mid-step
    return load_jsonl_dataset(
        data.train_jsonl, data.image_root, box_format=data.box_format, verify_images=True
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_output_dir_shared(out: Path, world: World) -> None:
    """fsdp over several nodes: every rank writes its checkpoint shards under `out` and rank 0 moves them into
    the checkpoint, so `out` must be one filesystem that every node sees (otherwise the shards of the other
    nodes never reach a checkpoint, found only when a resume fails). Every rank writes a marker there; rank 0
    must see them all. `dist.SharedError` on every rank naming the ranks it cannot see."""
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)  # before the token reaches the other ranks
    token = dist.broadcast_object(uuid.uuid4().hex if world.is_main else "")
    marker = out / f".shared-check-{token}-{world.rank}"
    with contextlib.suppress(OSError):  # a node without `out` cannot write it: rank 0 will not see it
        marker.touch()
    dist.barrier()
    missing = [r for r in range(world.world_size) if not (out / f".shared-check-{token}-{r}").exists()]
    missing = dist.broadcast_object(missing if world.is_main else [])
    dist.barrier()
    with contextlib.suppress(OSError):
        marker.unlink()
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise dist.SharedError(
            f"training.output_dir: {out} is not shared by every node: rank 0 cannot see what rank(s) {shown} "
            "wrote there; under parallelism: fsdp every rank writes its checkpoint shards into it, so put it on "
            "a filesystem all nodes mount at the same path"
        )


def build_learner(plan: TrainPlan, world: World) -> LearnerState:
    resolved = plan.resolved
    if resolved.world_size != world.world_size:
        raise ValueError(
            f"the plan was resolved for {resolved.world_size} learner rank(s) but this run has "
            f"{world.world_size} (launch.nnodes x launch.nproc_per_node): every node's launcher resolves "
            "it from the same config"
        )
    training, model = plan.training, plan.model
    out = training.output_dir
    if world.is_main:
        # the run-directory policy again (a no-op after the CLI's on one node; the only check multi-node)
        note = prepare_train_dir(out, training.resume_from_checkpoint, training.overwrite_output_dir)
        if note is not None:
            say("train-ab", note)
        check_output_dir(out)
    # cheap checks first, so a bad path fails in seconds and before any model is loaded
    samples = load_train_samples(plan.data)
    init_distributed(world, plan.launch.watchdog)
    if training.parallelism == "fsdp" and plan.launch.nnodes > 1:
        with dist.phase("start-up: is training.output_dir shared by every node", "startup_s"):
            check_output_dir_shared(out, world)
    with dist.phase("start-up: resume and model load", "startup_s"):
        # rank 0 alone resolves the checkpoint (`latest` ignores incomplete ones) and every rank
        # follows it, so no rank can pick another checkpoint (e.g. one written while it looked)
        resume, rank_state = shared_resume(training, world, len(samples))
        # every rank loads the same weights: the base model, or the checkpoint's on resume (with an
        # adapter the base never changes: it comes from model.name_or_path, the adapter from `adapter/`)
        adapter_cfg = model.adapter
        source = str(resume / "model") if resume and adapter_cfg is None else model.name_or_path
        try:
            problem = detection_model_problem(resolve_model_path(source))  # before any weight loads
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"model.name_or_path: {exc}") from None
        if problem is not None:
            raise ValueError(f"model.name_or_path: {problem}")
        device = device_for(world)
        seed_everything(training.seed)
        precision = Precision.from_config(model, training)
        # master weights in float32 (or the stored dtype itself, only when the user opted in); under
        # fsdp only rank 0 reads them, the other ranks build the structure on meta and get their shards
        on_meta = training.parallelism == "fsdp" and world.distributed and not world.is_main
        with ckpt.reading(resume if adapter_cfg is None else None, "model/"):
            bundle = load_bundle(
                source,
                torch_dtype=precision.param_dtype_name,
                device=str(device),
                attn_implementation=model.attn_implementation,
                add_coord_tokens=True,
                on_meta=on_meta,
            )
        if resume is not None and not on_meta:
            with ckpt.reading(resume, ckpt.MASTER_WEIGHTS):
                ckpt.load_master_weights(resume, bundle.model)
        if adapter_cfg is None:
            freeze = freeze_parts(
                bundle.model,
                vit=model.freeze_vit,
                aligner=model.freeze_aligner,
                llm=model.freeze_llm,
            )
        else:
            freeze = adapter.apply_adapter(bundle.model, adapter_cfg)
            if resume is not None:
                with ckpt.reading(resume, f"{adapter.ADAPTER_DIR}/"):
                    adapter.load_adapter(bundle.model, resume / adapter.ADAPTER_DIR)
        kernels = training.kernels
        applied = apply_speedups(
            bundle.model,
            device,
            liger=kernels.liger,
            packed_attention=kernels.packed_attention,
            torch_compile=kernels.compile_blocks,
        )
        if applied and world.is_main:
            say("train-ab", f"training.kernels: {', '.join(applied)}")
        bundle.model.train()
        bundle.model.config.use_cache = False
        if training.gradient_checkpointing:
            # non-reentrant: works with packed inputs, frozen parts and FSDP2's hooks
            bundle.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ddp_model: Any = bundle.model
        if training.parallelism == "fsdp":
            with dist.collective("FSDP2 sharding"):
                if world.distributed:
                    sharding.shard_from_rank0(
                        bundle.model, precision, device, world.world_size, is_main=world.is_main
                    )
                else:
                    sharding.shard(bundle.model, precision, device, world.world_size)
        elif world.distributed:
            with dist.collective("DDP construction (parameter broadcast)"):
                ddp_model = torch.nn.parallel.DistributedDataParallel(
                    bundle.model, device_ids=[world.local_rank] if device.type == "cuda" else None
                )
    vocab = TokenVocab.from_tokenizer(bundle.tokenizer)
    encoder = SampleEncoder(bundle=bundle, samples=samples, vocab=vocab)
    seed = training.seed
    a_sampler = ShardedSampler(
        len(samples), rank=world.rank, world_size=world.world_size, seed=seed, stream="A"
    )
    b_sampler = ShardedSampler(
        len(samples), rank=world.rank, world_size=world.world_size, seed=seed, stream="B"
    )
    optimizer, scheduler = build_optimizer(bundle.model, training)
    start_step, extra = 0, {}
    if resume is None and training.resume_from_checkpoint is not None and world.is_main:
        say("train-ab", f"resume: no checkpoint in {out} yet; starting a new run")
    if resume is not None:
        state = ckpt.load_trainer_state(resume)
        with (
            dist.phase("start-up: load the optimizer state", "startup_s"),
            ckpt.reading(resume, "optimizer state"),
        ):
            ckpt.load_optimizer_state(resume, bundle.model, optimizer, scheduler)
        with ckpt.reading(resume, "rng.pt"):
            ckpt.restore_rng(ckpt.load_rng_states(resume)[world.rank])
        start_step = state.global_step
        if world.is_main:
            say("train-ab", resume_note(resume, start_step, training.max_steps))
        a_sampler.num_consumed = int(rank_state["a_consumed"])
        b_sampler.num_consumed = int(rank_state["b_consumed"])
        extra = {**state.extra, "rank_state": rank_state}
    if world.is_main:
        plain = dict(plan.run_config)
        # --overwrite acted on this start only: config.yaml reused to resume or re-run must not move the run aside
        plain["training"] = {**plain["training"], "overwrite_output_dir": False}
        if resume is not None:  # every resume check passed: the config that trained the steps so far stays
            plain, moved = record_resume(out, plain, resume, start_step)
            if moved is not None:
                say("train-ab", moved)
        write_resolved_config(out, plain)
        write_train_plan(out / PLAN_FILE, plan)  # what the ranks ran (a record; config.yaml is the input)
        mark_running(out)  # removed however the run ends in this process (cli.train_ab)
    return LearnerState(
        plan=plan,
        resolved=resolved,
        world=world,
        device=device,
        bundle=bundle,
        ddp_model=ddp_model,
        precision=precision,
        grad_scaler=precision.grad_scaler(device),
        freeze=freeze,
        encoder=encoder,
        a_sampler=a_sampler,
        b_sampler=b_sampler,
        optimizer=optimizer,
        scheduler=scheduler,
        coord_token_ids=torch.tensor(bundle.coord_token_ids, dtype=torch.long, device=device),
        start_step=start_step,
        resumed_from=resume,
        extra_state=extra,
    )


def shared_resume(
    training: TrainingConfig, world: World, num_samples: int
) -> tuple[Path | None, dict[str, Any]]:
    """Rank 0 resolves `training.resume_from_checkpoint` and checks it fits this world and this training
    set (`num_samples`); every rank gets the same checkpoint (or the same error) and its own saved stream
    positions."""
    decided: tuple[str | None, str | None] = (None, None)
    if world.is_main:
        try:
            found = ckpt.resolve_resume(training.resume_from_checkpoint, training.output_dir)
            if found is not None:
                with ckpt.reading(found, f"{ckpt.TRAINER_STATE} or rng.pt"):
                    ckpt.check_world_size(found, world.world_size)
                    ckpt.check_train_set(found, num_samples)
            decided = (None if found is None else str(found), None)
        except (FileNotFoundError, ValueError) as exc:
            decided = (None, str(exc))
    path_text, error = dist.broadcast_object(decided)
    if error is not None:
        raise dist.SharedError(error)
    if path_text is None:
        return None, {}
    path = Path(path_text)
    return path, ckpt.load_rank_state(path, world.rank)
