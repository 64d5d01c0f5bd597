"""`run_doctor`: every check in order, cheap ones first (config, run directory, data files, servers,
tokenizer), then the
ones that need the model (load, resources, sample lengths, the packed forward, `--push`). Each line is
handed to `emit` as soon as it is known, so a slow step shows what it is waiting on.

The doctor probes every role, so `run_doctor` alone holds the root config: it resolves it once into the
parts each check probes (the model and training sections, the learner's rollout servers, the memory
model's knobs) and hands each check its part."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stagectl.config import effective_world_size
from stagectl.config.plan_server import learner_servers
from stagectl.doctor.config_check import check_config
from stagectl.doctor.data_checks import (
    check_box_format,
    check_eval_file,
    check_longest_sample,
    load_samples,
    sample_lengths,
)
from stagectl.doctor.model_checks import check_tokenizer, load_model
from stagectl.doctor.report import Check, fail, skip
from stagectl.doctor.resource_checks import check_resources
from stagectl.doctor.run_dir_check import check_run_dir
from stagectl.doctor.server_checks import check_push, check_servers
from stagectl.memory.from_config import knobs_from_config


@dataclass(frozen=True)
class DoctorOptions:
    config: Path
    overrides: list[str] = field(default_factory=list)
    world_size: int | None = None  # None: $WORLD_SIZE, else launch.nproc_per_node x launch.nnodes
    push: bool = False  # one real weight push to every server
    resume: bool = False  # the run is started with train-ab --resume


def run_doctor(options: DoctorOptions, emit: Callable[[Check], None] = lambda check: None) -> list[Check]:
    import torch

    checks: list[Check] = []

    def add(*new: Check) -> None:
        for check in new:
            checks.append(check)
            emit(check)

    cfg, lines = check_config(options.config, list(options.overrides), options.world_size)
    add(*lines)
    if cfg is None:
        return checks
    assert cfg.data is not None  # check_config refuses configs without one
    add(check_run_dir(cfg.training, options.resume))
    servers = learner_servers(cfg)
    knobs = knobs_from_config(
        cfg.model,
        cfg.training,
        global_max_length=cfg.global_max_length,
        world_size=effective_world_size(cfg, options.world_size),
    )
    samples, lines = load_samples(cfg.data)
    add(*lines, *check_eval_file(cfg.data), *check_box_format(cfg.data))
    add(*check_servers(servers))
    loadable, lines = check_tokenizer(cfg.model, servers.rollout_engine)
    add(*lines)
    bundle = None
    if loadable:
        bundle, line = load_model(cfg.model, "cuda" if torch.cuda.is_available() else "cpu")
        add(line)
    add(*check_resources(cfg.model, cfg.training, cfg.launch.nproc_per_node, knobs))
    if bundle is None or samples is None:
        why = "needs the model" if bundle is None else "needs the data"
        add(skip("data.longest_sample", why), skip("packing.forward", why))
    else:
        from stagectl.doctor.packing_check import check_packed_forward

        try:
            lengths = sample_lengths(bundle, samples)
        except ValueError as exc:  # e.g. a vision-language family whose images stagectl cannot encode
            add(fail("data.longest_sample", str(exc), "train-ab trains Qwen-VL models (model.name_or_path)"))
        else:
            add(*check_longest_sample(cfg.global_max_length, lengths))
            add(check_packed_forward(cfg.global_max_length, cfg.training, bundle, samples, lengths))
    if options.push:
        add(check_push(servers, bundle) if bundle is not None else skip("server.push", "needs the model"))
    return checks
