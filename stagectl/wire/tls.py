"""TLS contexts of the rollout server (both ports) and of its clients (httpx and the chunk sender).

The server loads `rollout_server.tls_certfile` / `tls_keyfile`; a client verifies the server's certificate
against the system's trust store, or a CA file (a self-signed certificate is its own CA), and skips the
check only when told so explicitly (`tls_skip_verify`). `check_client_credentials` reads what a client of a
server list needs from outside the config (the CA file, the token's variable) before a launcher starts anything."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from stagectl.wire.protocol import read_token

if TYPE_CHECKING:
    from stagectl.config.plan import ServerList


def server_context(certfile: Path, keyfile: Path) -> ssl.SSLContext:
    """The server side; `ValueError` naming the files when they do not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"rollout_server.tls_certfile / tls_keyfile: cannot load {certfile} with {keyfile}: {exc}"
        ) from None
    return context


def client_context(ca_file: Path | None = None, *, skip_verify: bool = False) -> ssl.SSLContext:
    """The client side: verify against `ca_file` (else the system's trust store), or not at all when
    `skip_verify` (the two exclude each other)."""
    if skip_verify:
        if ca_file is not None:
            raise ValueError("tls_ca_file and tls_skip_verify exclude each other: verify, or do not")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    try:
        return ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"tls_ca_file: cannot load {ca_file}: {exc}") from None


def check_client_credentials(servers: ServerList) -> None:
    """`ValueError` naming the key when a client of `servers` could not be built: the variable
    `auth_token_env` names unset or empty, or (for `https://` servers) `tls_ca_file` not loading. The rollout
    client reads both only when it is built, after the learner's model has loaded."""
    read_token(servers.auth_token_env, servers.token_key)
    if any(url.startswith("https://") for url in servers.base_urls):
        try:
            client_context(servers.tls_ca_file, skip_verify=servers.tls_skip_verify)
        except ValueError as exc:
            raise ValueError(f"{servers.key}.{exc}") from None
