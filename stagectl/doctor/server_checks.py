"""Rollout-server checks (train-ab with external servers, `rollout_backend: vllm`): each server is
reachable (`/health/`), accepts the token (`/version/` needs it when the server has one), runs this
stagectl version, the configured engine and the dtype weight syncs will carry, and its weight transport
is reachable (the weight-stream port, or the learner's weight-group address). `--push` then runs one
real weight push of the loaded model to every server (`check_push`).

The probes are plain HTTP/TCP with short timeouts: a preflight must answer in seconds, so nothing here
retries (`RolloutClient` does, during training)."""

from __future__ import annotations

import socket
import ssl
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

import stagectl
from stagectl.config import StagectlConfig, uses_server_rollouts
from stagectl.config.engines import ENGINES
from stagectl.doctor.report import Check, fail, ok, skip, warn
from stagectl.wire.protocol import VersionResponse, read_token

if TYPE_CHECKING:
    from stagectl.models.loading import ModelBundle

PROBE_TIMEOUT_S = 5.0
SERVERS_KEY = "custom.extra.rollout_matching.vllm.server"
START_FIX = (
    "start it with `stagectl rollout-server CONFIG` (the same config), or fix " + SERVERS_KEY + ".servers"
)


def external_servers(cfg: StagectlConfig) -> tuple[list[str], Check | None]:
    """The base URLs to probe, or a skip line saying why there are none."""
    if not uses_server_rollouts(cfg):
        return [], skip("server", "rollouts run in the learner (rollout_backend: hf): no server to check")
    if cfg.rollout_server.embedded:
        return [], skip("server", "rollout_server.embedded: train-ab starts its own server on loopback")
    urls = [s.base_url.rstrip("/") for s in cfg.custom.extra.rollout_matching.vllm.server.servers]
    return urls, None


def expected_sync_dtype(cfg: StagectlConfig) -> str:
    """The dtype the learner's weight syncs carry to an `rollout_server.engine` server."""
    adapter_sync = (
        cfg.model.adapter is not None and cfg.custom.extra.rollout_matching.vllm.sync.mode == "adapter"
    )
    if adapter_sync and ENGINES[cfg.rollout_server.engine].merges_adapter:
        return "float32"  # peft's adapter tensors, merged by the server onto its float32 base
    return cfg.model.torch_dtype


def check_servers(cfg: StagectlConfig) -> list[Check]:
    urls, none = external_servers(cfg)
    if none is not None:
        return [none]
    server_cfg = cfg.custom.extra.rollout_matching.vllm.server
    try:
        token = read_token(server_cfg.auth_token_env, f"{SERVERS_KEY}.auth_token_env")
    except ValueError as exc:
        return [fail("server.token", str(exc), f"export ${server_cfg.auth_token_env} before training")]
    tls: ssl.SSLContext | None = None
    if any(url.startswith("https://") for url in urls):
        from stagectl.wire.tls import client_context

        try:
            tls = client_context(server_cfg.tls_ca_file, skip_verify=server_cfg.tls_skip_verify)
        except ValueError as exc:
            return [
                fail("server.tls", str(exc), f"set {SERVERS_KEY}.tls_ca_file to the servers' CA certificate")
            ]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    checks: list[Check] = []
    with httpx.Client(timeout=PROBE_TIMEOUT_S, verify=tls or True) as http:
        for k, url in enumerate(urls):
            checks += check_server(cfg, http, k, url, headers, token is not None)
    return checks


def check_server(
    cfg: StagectlConfig, http: httpx.Client, k: int, url: str, headers: dict[str, str], has_token: bool
) -> list[Check]:
    """The lines of server `k`; stops at the first probe that makes the next ones meaningless."""
    name = f"server[{k}]"
    try:
        health = http.get(f"{url}/health/")
    except httpx.HTTPError as exc:
        return [fail(f"{name}.reachable", f"{url}: {type(exc).__name__}: {exc}", START_FIX)]
    if health.status_code != 200:
        return [fail(f"{name}.reachable", f"{url}/health/ answers HTTP {health.status_code}", START_FIX)]
    checks = [ok(f"{name}.reachable", f"{url} is up")]
    try:
        response = http.get(f"{url}/version/", headers=headers)
    except httpx.HTTPError as exc:
        return [*checks, fail(f"{name}.version", f"{url}/version/: {type(exc).__name__}: {exc}", START_FIX)]
    if response.status_code == 401:
        fix = (
            f"export the server's token in ${cfg.custom.extra.rollout_matching.vllm.server.auth_token_env}"
            if has_token
            else f"the server wants a token: set {SERVERS_KEY}.auth_token_env to a variable holding it"
        )
        return [*checks, fail(f"{name}.auth", f"{url} refuses the token (HTTP 401)", fix)]
    if response.status_code == 404:
        return [
            *checks,
            fail(
                f"{name}.version",
                f"{url} has no /version/: not a stagectl rollout server (a swift server serves inference only)",
                "serve with `stagectl rollout-server` (docs/swift_interop.md)",
            ),
        ]
    if response.status_code != 200:
        return [
            *checks,
            fail(f"{name}.version", f"{url}/version/ answers HTTP {response.status_code}", START_FIX),
        ]
    checks.append(ok(f"{name}.auth", "token accepted" if has_token else "no token needed"))
    try:
        info = VersionResponse.model_validate(response.json())
    except (ValueError, ValidationError) as exc:
        return [
            *checks,
            fail(f"{name}.version", f"{url}/version/ sent an unreadable answer: {exc}", START_FIX),
        ]
    checks += [_version(name, info), _engine(cfg, name, info), _weight_transport(cfg, name, url, info)]
    return checks


def _version(name: str, info: VersionResponse) -> Check:
    serving = f"serving weight version {info.version} of {info.model}"
    if not info.stagectl_version:
        return warn(
            f"{name}.version",
            f"the server does not report its stagectl version (older than this {stagectl.__version__}); {serving}",
            "restart it with this stagectl",
        )
    if info.stagectl_version != stagectl.__version__:
        return fail(
            f"{name}.version",
            f"the server runs stagectl {info.stagectl_version}, this learner {stagectl.__version__}",
            "install the same stagectl on the server and the learner",
        )
    return ok(f"{name}.version", f"stagectl {info.stagectl_version}, {serving}")


def _engine(cfg: StagectlConfig, name: str, info: VersionResponse) -> Check:
    engine, dtype = cfg.rollout_server.engine, expected_sync_dtype(cfg)
    problems = []
    if info.engine != engine:
        problems.append(f"engine {info.engine!r}, configured {engine!r} (rollout_server.engine)")
    if info.sync_dtype and info.sync_dtype != dtype:
        problems.append(f"weights in {info.sync_dtype}, but the learner syncs {dtype} (model.torch_dtype)")
    if problems:
        return fail(
            f"{name}.engine",
            "; ".join(problems),
            "start the server from this config (`stagectl rollout-server CONFIG`) or make rollout_server.engine "
            "and model.torch_dtype say what it runs",
        )
    shown = info.sync_dtype or "dtype not reported"
    return ok(f"{name}.engine", f"{info.engine}, {shown}")


def _weight_transport(cfg: StagectlConfig, name: str, url: str, info: VersionResponse) -> Check:
    sync = cfg.custom.extra.rollout_matching.vllm.sync
    check_name = f"{name}.weight_transport"
    if sync.transport == "http":
        host = urlsplit(url).hostname or ""
        port = info.weight_stream_port or urlsplit(url).port or (443 if url.startswith("https://") else 80)
        where = "weight-stream port" if info.weight_stream_port else "app port (no weight-stream port)"
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                pass
        except OSError as exc:
            return fail(
                check_name,
                f"http: the {where} {host}:{port} does not accept connections ({exc})",
                "open that port between learner and server, or fix rollout_server.weight_stream_port there",
            )
        return ok(check_name, f"http: {where} {host}:{port} accepts connections")
    if sync.transport == "collective":
        try:
            with socket.socket(socket.AF_INET6 if ":" in sync.group_address else socket.AF_INET) as s:
                s.bind((sync.group_address, 0))
        except OSError as exc:
            return fail(
                check_name,
                f"collective: cannot listen on group_address {sync.group_address} ({exc})",
                "set custom.extra.rollout_matching.vllm.sync.group_address to an address of this node",
            )
        return ok(
            check_name,
            f"collective: this node can host the weight group at {sync.group_address} (--push proves the "
            "servers reach it)",
        )
    return ok(check_name, f"{sync.transport}: snapshots by path (--push proves the server may read them)")


def check_push(cfg: StagectlConfig, bundle: ModelBundle) -> Check:
    """One full weight push of the loaded (base) model to every server as the next version, over the
    configured transport, then every server's version read back. Servers then serve the base weights at
    that version; train-ab pushes its own weights before its first Channel-B rollouts anyway."""
    import torch

    from stagectl.config.plan import server_rollouts
    from stagectl.weightsync.client import WeightSyncClient
    from stagectl.weightsync.errors import WeightPushError
    from stagectl.wire.errors import RolloutRequestError

    name = "server.push"
    _, none = external_servers(cfg)
    if none is not None:
        return skip(name, none.message)
    rm = cfg.custom.extra.rollout_matching
    if rm.vllm.sync.mode == "adapter" and cfg.model.adapter is not None:
        return skip(name, "adapter syncs carry a trained adapter; --push checks full syncs only")
    dtype = getattr(torch, cfg.model.torch_dtype)
    state = {n: t.detach().to("cpu", dtype=dtype) for n, t in bundle.model.state_dict().items()}
    fix = "read the server's log; a shape or dtype mismatch means the server runs another checkpoint"
    sync = rm.vllm.sync
    disk_dir = (
        sync.disk_dir if sync.transport == "disk" else None
    ) or cfg.training.output_dir / "weight_sync"
    created = [p for p in (disk_dir, *disk_dir.parents) if not p.exists()]  # removed again if left empty
    try:
        with WeightSyncClient.for_rollouts(server_rollouts(cfg)) as client:
            target = max(v.version for v in client.versions()) + 1
            report = client.push_weights(state, target)
            served = [v.version for v in client.versions()]
    except (WeightPushError, RolloutRequestError, httpx.HTTPError, ValueError) as exc:
        return fail(name, f"{rm.vllm.sync.transport} push failed: {exc}", fix)
    finally:
        for path in created:  # innermost first: doctor leaves no run directory behind
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
    if any(v != target for v in served):
        return fail(name, f"pushed version {target}, the servers report {served}", fix)
    return ok(
        name,
        f"pushed {report.num_bytes / 1e6:.1f} MB as version {target} over {report.transport} in "
        f"{report.seconds:.2f} s; every server serves it",
    )
