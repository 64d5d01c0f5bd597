"""Named cross-section validators of `StagectlConfig`: one rule each.

Each `validate_*` function checks one rule across sections and returns `Problem`s (never raises), so
`load_config` can report every problem at once; each message says what to do instead.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from stagectl.config.placement import validate_placement
from stagectl.config.root import (
    LOOPBACK_HOSTS,
    Problem,
    StagectlConfig,
    is_train_ab,
    is_zero_ratio,
    resolve_gas,
    uses_server_rollouts,
)
from stagectl.config.stage_b import MISSION_NAME
from stagectl.config.validators_server import (
    validate_embedded_server,
    validate_server_access,
    validate_server_limits,
    validate_server_list,
    validate_server_security,
)
from stagectl.config.validators_training import (
    validate_adapter,
    validate_kernels,
    validate_parallelism,
    validate_precision,
    validate_run_dir_choice,
)


def validate_b_ratio_present(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if not is_train_ab(cfg):
        return []
    if cfg.stage2_ab is None or cfg.stage2_ab.schedule.b_ratio is None:
        return [
            Problem(
                "stage2_ab.schedule.b_ratio",
                "required for custom.trainer_variant: stage2_ab_training; set it to the fraction of "
                "Channel-B optimizer steps (0.0 = A only, 1.0 = B only, e.g. 0.25)",
            )
        ]
    return []


def validate_channel_b_mode_world_size(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if cfg.stage2_ab is None or cfg.stage2_ab.channel_b.mode != "step" or world_size <= 1:
        return []
    ratio = cfg.stage2_ab.schedule.b_ratio
    if ratio is not None and is_zero_ratio(ratio):
        return []  # A-only runs never enter Channel-B, so step mode is harmless on many ranks
    return [
        Problem(
            "stage2_ab.channel_b.mode",
            f"'step' runs Channel-B on one learner rank only, but the world size is {world_size}; "
            "use stage2_ab.channel_b.mode: async (with server rollouts) for multi-rank Channel-B, "
            "or run with one process",
        )
    ]


def validate_insertion_order_needs_clean_prefix(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    cb = cfg.stage2_ab.channel_b if cfg.stage2_ab is not None else None
    if cb is None or cb.insertion_order != "sorted" or cb.target == "clean_prefix":
        return []
    return [
        Problem(
            "stage2_ab.channel_b.insertion_order",
            f"'sorted' re-orders the clean-prefix target, but target is {cb.target!r} ("
            + (
                "the raw rollout prefix is kept as generated"
                if cb.target == "raw_prefix"
                else "its order is the rollout's by definition; sorted would make it Channel-A"
            )
            + "); set stage2_ab.channel_b.target: clean_prefix or insertion_order: tail_append",
        )
    ]


def validate_async_needs_server_rollouts(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if cfg.stage2_ab is None or cfg.stage2_ab.channel_b.mode != "async":
        return []
    rm = cfg.custom.extra.rollout_matching
    problems = []
    if rm.rollout_backend != "vllm":
        problems.append(
            Problem(
                "custom.extra.rollout_matching.rollout_backend",
                "stage2_ab.channel_b.mode: async needs server rollouts; set rollout_backend: vllm "
                "with vllm.mode: server (a stagectl rollout-server, engine hf or vllm)",
            )
        )
    return problems


def validate_sync_mode_supported(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    """`adapter` sends the adapter only: it needs `model.adapter` and full syncs (the schema keeps it on http)."""
    sync = cfg.custom.extra.rollout_matching.vllm.sync
    if sync.mode != "adapter":
        return []
    key = "custom.extra.rollout_matching.vllm.sync.mode"
    if cfg.model.adapter is None:
        return [
            Problem(
                key,
                "adapter syncs the adapter of model.adapter, which is not set; set it or use mode: full",
                about=("model.adapter",),
            )
        ]
    if sync.transport == "http" and sync.delta:
        return [
            Problem(
                key, "adapter syncs run without delta (the adapter is small); set delta: false, or mode: full"
            )
        ]
    return []


def validate_sync_transport(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    rm = cfg.custom.extra.rollout_matching
    sync = rm.vllm.sync
    problems = []
    remote = [s.base_url for s in rm.vllm.server.servers if _url_host(s.base_url) not in LOOPBACK_HOSTS]
    if sync.transport == "collective" and sync.group_address in LOOPBACK_HOSTS and remote:
        problems.append(
            Problem(
                "custom.extra.rollout_matching.vllm.sync.group_address",
                f"{', '.join(remote)} cannot reach the weight group at {sync.group_address}; set "
                "vllm.sync.group_address to an address of the learner's node the servers can reach",
            )
        )
    return problems


def _url_host(url: str) -> str:
    host = urlsplit(url).hostname
    return host or ""


def validate_pipeline_needs_server(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if cfg.stage2_ab is None or not cfg.stage2_ab.channel_b.enable_pipeline:
        return []
    problems = []
    if not uses_server_rollouts(cfg):
        problems.append(
            Problem(
                "stage2_ab.channel_b.enable_pipeline",
                "the in-step pipeline overlaps server rollouts with learning; it needs "
                "custom.extra.rollout_matching.rollout_backend: vllm with vllm.mode: server, "
                "or set enable_pipeline: false",
            )
        )
    if cfg.stage2_ab.channel_b.mode != "step":
        problems.append(
            Problem(
                "stage2_ab.channel_b.enable_pipeline",
                "applies to step mode only (async mode always overlaps); set enable_pipeline: false",
            )
        )
    return problems


def validate_async_queue_limits(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if cfg.stage2_ab is None or cfg.stage2_ab.channel_b.mode != "async":
        return []
    acfg = cfg.stage2_ab.channel_b.async_
    gas = resolve_gas(cfg, world_size)
    problems = []
    if gas is not None and acfg.queue_limit < gas:
        problems.append(
            Problem(
                "stage2_ab.channel_b.async.queue_limit",
                f"{acfg.queue_limit} is smaller than gradient_accumulation_steps ({gas}): a B step needs GAS "
                f"packs of one version on every rank, so the feasibility gate could never pass; "
                f"set queue_limit >= {gas}",
            )
        )
    if acfg.prefetch_target_packs > acfg.queue_limit:
        problems.append(
            Problem(
                "stage2_ab.channel_b.async.prefetch_target_packs",
                f"{acfg.prefetch_target_packs} is larger than queue_limit ({acfg.queue_limit}): the "
                "prefetcher would produce packs only to drop them; set prefetch_target_packs <= queue_limit",
            )
        )
    if gas is not None and acfg.prefetch_target_packs < gas:
        problems.append(
            Problem(
                "stage2_ab.channel_b.async.prefetch_target_packs",
                f"{acfg.prefetch_target_packs} is smaller than gradient_accumulation_steps ({gas}): a B "
                f"step needs GAS packs queued; set prefetch_target_packs >= {gas}",
            )
        )
    return problems


def validate_batch_sizes(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    t = cfg.training
    if t.effective_batch_size is None:
        return []
    per_step = t.per_device_train_batch_size * world_size
    gas = resolve_gas(cfg, world_size)
    if t.gradient_accumulation_steps is None:
        if gas is None:
            return [
                Problem(
                    "training.effective_batch_size",
                    f"{t.effective_batch_size} is not a multiple of per_device_train_batch_size x world_size "
                    f"({t.per_device_train_batch_size} x {world_size} = {per_step}); pick a multiple of "
                    f"{per_step} or set gradient_accumulation_steps instead",
                )
            ]
        return []
    if per_step * (gas or 0) != t.effective_batch_size:
        return [
            Problem(
                "training.effective_batch_size",
                f"{t.effective_batch_size} != per_device_train_batch_size x world_size x "
                f"gradient_accumulation_steps ({t.per_device_train_batch_size} x {world_size} x "
                f"{t.gradient_accumulation_steps}); remove one of effective_batch_size / gradient_accumulation_steps",
            )
        ]
    return []


def validate_stage_b(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if cfg.mission is None and not cfg.tickets and cfg.guidance is None:
        return []
    problems = []
    if cfg.mission is None:
        problems.append(Problem("mission", "required for Stage-B; set the mission name"))
    elif not MISSION_NAME.fullmatch(cfg.mission):
        problems.append(
            Problem(
                "mission",
                f"{cfg.mission!r} is not a plain name: it becomes the run's directory "
                "({output.root}/{output.run_name}/{mission}); use letters (any script), digits, _ . - (first a "
                "letter or digit)",
            )
        )
    if not cfg.tickets:
        problems.append(Problem("tickets", "required for Stage-B; list the tickets JSONL files"))
    if cfg.guidance is None:
        problems.append(
            Problem("guidance.path", "required for Stage-B; point it at the mission guidance JSON")
        )
    return problems


def validate_stage_b_runner(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if cfg.mission is None:
        return []
    problems = []
    runner = cfg.runner
    if runner.engine == "server" and not runner.server.base_urls:
        problems.append(
            Problem(
                "runner.server.base_urls",
                "runner.engine: server needs at least one rollout server URL, e.g. [http://127.0.0.1:8000]",
            )
        )
    if cfg.launch.nnodes != 1:
        problems.append(
            Problem("launch.nnodes", "stage-b runs on one node (torchrun --nnodes=1); set launch.nnodes: 1")
        )
    return problems


def validate_packing_batch(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    """Under packing a micro-batch is one packed sequence; several would be gradient accumulation."""
    t = cfg.training
    if not t.packing or t.per_device_train_batch_size == 1:
        return []
    return [
        Problem(
            "training.per_device_train_batch_size",
            f"is {t.per_device_train_batch_size}, but with training.packing: true a micro-batch is one packed "
            "sequence of up to global_max_length tokens, so it counts packed sequences and must be 1. "
            "For more tokens per optimizer step raise gradient_accumulation_steps (or global_max_length); "
            "for N padded samples per micro-batch set training.packing: false",
        )
    ]


def validate_launch(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    """Multi-node runs meet at one rendezvous endpoint; single-node runs pick their own on loopback."""
    launch = cfg.launch
    if launch.nnodes == 1:
        if launch.rdzv_endpoint is not None:
            return [
                Problem(
                    "launch.rdzv_endpoint",
                    "is for multi-node runs (launch.nnodes > 1); a single-node run rendezvouses on "
                    "127.0.0.1 (set launch.master_port to fix its port)",
                )
            ]
        return []
    endpoint = launch.rdzv_endpoint
    if not endpoint:
        return [
            Problem(
                "launch.rdzv_endpoint",
                f"required with launch.nnodes: {launch.nnodes}; set it to host:port of the node that "
                "hosts the rendezvous (the same on every node), e.g. node0.cluster:29400",
            )
        ]
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return [
            Problem("launch.rdzv_endpoint", f"must be host:port (e.g. node0.cluster:29400), got {endpoint!r}")
        ]
    if launch.master_port is not None:
        return [
            Problem("launch.master_port", "is for single-node runs; multi-node runs use launch.rdzv_endpoint")
        ]
    return []


VALIDATORS = (
    validate_b_ratio_present,
    validate_channel_b_mode_world_size,
    validate_insertion_order_needs_clean_prefix,
    validate_async_needs_server_rollouts,
    validate_sync_mode_supported,
    validate_sync_transport,
    validate_pipeline_needs_server,
    validate_async_queue_limits,
    validate_batch_sizes,
    validate_server_security,
    validate_server_access,
    validate_server_limits,
    validate_embedded_server,
    validate_server_list,
    validate_stage_b,
    validate_stage_b_runner,
    validate_launch,
    validate_packing_batch,
    validate_precision,
    validate_parallelism,
    validate_adapter,
    validate_kernels,
    validate_run_dir_choice,
    validate_placement,
)


# The rules that judge the training world (ranks x batch and GAS, Channel-B on one rank, fsdp's shards):
# the only ones that read the world size. A command that does not train (eval: its --nproc shards images)
# runs without them.
TRAINING_WORLD_RULES = (
    validate_channel_b_mode_world_size,
    validate_async_queue_limits,
    validate_batch_sizes,
    validate_parallelism,
)


def run_validators(cfg: StagectlConfig, world_size: int | None) -> list[Problem]:
    """Every rule's problems; `world_size` None (a command that does not train) skips
    `TRAINING_WORLD_RULES` (the other rules do not read it)."""
    problems: list[Problem] = []
    for check in VALIDATORS:
        if world_size is not None:
            problems.extend(check(cfg, world_size))
        elif check not in TRAINING_WORLD_RULES:
            problems.extend(check(cfg, 1))
    return problems
