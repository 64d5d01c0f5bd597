"""Rollout-server checks (train-ab with external servers, `rollout_backend: vllm`): each server is
reachable (`/health/`), accepts the token (`/version/` needs it when the server has one), runs this
stagectl version, the configured engine and the dtype weight syncs will carry, and its weight transport
is reachable (the weight-stream port, or the learner's weight-group address). `--push` then runs one
real weight push of the loaded model to every server (`check_push`).

The probes are plain HTTP/TCP, each whole within `PROBE_TIMEOUT_S` (`wire.deadline`: a server that
trickles its answer fails, it does not hang the doctor): a preflight must answer in seconds, so nothing here
retries (`RolloutClient` does, during training)."""

from __future__ import annotations

import socket
import ssl
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

import stagectl
from stagectl.config.plan import SERVERS_KEY, ServerRollouts
from stagectl.config.plan_server import LearnerServers
from stagectl.config.rollout import DiskSync
from stagectl.doctor.report import Check, fail, ok, skip, warn
from stagectl.wire.deadline import DeadlineClient
from stagectl.wire.protocol import VersionResponse, read_token

if TYPE_CHECKING:
    from stagectl.models.loading import ModelBundle

PROBE_TIMEOUT_S = 5.0
START_FIX = (
    "start it with `stagectl rollout-server CONFIG` (the same config), or fix " + SERVERS_KEY + ".servers"
)


def external_servers(servers: LearnerServers) -> tuple[ServerRollouts | None, Check | None]:
    """The servers to probe, or a skip line saying why there are none."""
    if servers.rollouts is None:
        return None, skip("server", "rollouts run in the learner (rollout_backend: hf): no server to check")
    if servers.embedded:
        return None, skip("server", "rollout_server.embedded: train-ab starts its own server on loopback")
    return servers.rollouts, None


def check_servers(servers: LearnerServers) -> list[Check]:
    rollouts, none = external_servers(servers)
    if rollouts is None:
        assert none is not None
        return [none]
    listed = rollouts.servers
    try:
        token = read_token(listed.auth_token_env, listed.token_key)
    except ValueError as exc:
        return [fail("server.token", str(exc), f"export ${listed.auth_token_env} before training")]
    tls: ssl.SSLContext | None = None
    if any(url.startswith("https://") for url in listed.base_urls):
        from stagectl.wire.tls import client_context

        try:
            tls = client_context(listed.tls_ca_file, skip_verify=listed.tls_skip_verify)
        except ValueError as exc:
            return [
                fail("server.tls", str(exc), f"set {SERVERS_KEY}.tls_ca_file to the servers' CA certificate")
            ]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    checks: list[Check] = []
    # each probe whole within PROBE_TIMEOUT_S: a server that trickles its answer fails the check, not hangs it
    with DeadlineClient(total_s=PROBE_TIMEOUT_S, timeout=PROBE_TIMEOUT_S, verify=tls or True) as http:
        for k, url in enumerate(listed.base_urls):
            checks += check_server(servers, http, k, url, headers, token is not None)
    return checks


def check_server(
    servers: LearnerServers, http: httpx.Client, k: int, url: str, headers: dict[str, str], has_token: bool
) -> list[Check]:
    """The lines of server `k`; stops at the first probe that makes the next ones meaningless."""
    rollouts = servers.rollouts
    assert rollouts is not None  # `check_servers` probes external servers only
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
            f"export the server's token in ${rollouts.servers.auth_token_env}"
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
    checks += [
        _version(name, info),
        _engine(servers, name, info),
        _weight_transport(rollouts, name, url, info),
    ]
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


def _engine(servers: LearnerServers, name: str, info: VersionResponse) -> Check:
    engine, dtype = servers.engine, servers.sync_dtype
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


def _weight_transport(rollouts: ServerRollouts, name: str, url: str, info: VersionResponse) -> Check:
    sync = rollouts.sync
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


def check_push(servers: LearnerServers, bundle: ModelBundle) -> Check:
    """One full weight push of the loaded (base) model to every server as the next version, over the
    configured transport, then every server's version read back. Servers then serve the base weights at
    that version; train-ab pushes its own weights before its first Channel-B rollouts anyway."""
    import torch

    from stagectl.weightsync.client import WeightSyncClient
    from stagectl.weightsync.errors import WeightPushError
    from stagectl.wire.errors import RolloutRequestError

    name = "server.push"
    rollouts, none = external_servers(servers)
    if rollouts is None:
        assert none is not None
        return skip(name, none.message)
    if servers.adapter_sync:
        return skip(name, "adapter syncs carry a trained adapter; --push checks full syncs only")
    dtype = getattr(torch, servers.sync_dtype)  # a full sync carries model.torch_dtype
    state = {n: t.detach().to("cpu", dtype=dtype) for n, t in bundle.model.state_dict().items()}
    fix = "read the server's log; a shape or dtype mismatch means the server runs another checkpoint"
    sync = rollouts.sync
    # a disk sync's directory (the plan resolved its default, `{output_dir}/weight_sync`)
    disk_dir = sync.disk_dir if isinstance(sync, DiskSync) else None
    created = (  # removed again if left empty
        [p for p in (disk_dir, *disk_dir.parents) if not p.exists()] if disk_dir is not None else []
    )
    try:
        with WeightSyncClient.for_rollouts(rollouts) as client:
            target = max(v.version for v in client.versions()) + 1
            report = client.push_weights(state, target)
            served = [v.version for v in client.versions()]
    except (WeightPushError, RolloutRequestError, httpx.HTTPError, ValueError) as exc:
        return fail(name, f"{sync.transport} push failed: {exc}", fix)
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
