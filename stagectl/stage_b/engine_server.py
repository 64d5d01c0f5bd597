"""`runner.engine: server`: rollouts from running rollout servers through `inference.client.RolloutClient`.

The Stage-B processes hold no model. Each `judge` call is one `infer` over the rank's shard (the client
spreads it over the servers, retries and splits); request i is sampled with `spec.seed + i`.
"""

from __future__ import annotations

from collections.abc import Sequence

from stagectl.config.stage_b import StageBServerConfig
from stagectl.inference.client import RolloutClient
from stagectl.config.sampling import SamplingSpec
from stagectl.stage_b.engine import JudgeRequest, ReflectRequest
from stagectl.stage_b.prompts import Message as ChatMessage
from stagectl.wire.protocol import InferRequest, Message, RequestConfig, read_token


class ServerBackend:
    def __init__(self, client: RolloutClient) -> None:
        self.client = client

    def judge(self, requests: Sequence[JudgeRequest], spec: SamplingSpec, seed: int) -> list[str]:
        return self._infer([r.messages for r in requests], spec, seed)

    def reflect(self, request: ReflectRequest, spec: SamplingSpec, seed: int) -> str:
        return self._infer([request.messages], spec, seed)[0]

    def _infer(self, conversations: Sequence[list[ChatMessage]], spec: SamplingSpec, seed: int) -> list[str]:
        requests = [
            InferRequest(messages=[Message(role=m["role"], content=m["content"]) for m in messages])  # type: ignore[arg-type]
            for messages in conversations
        ]
        config = RequestConfig.from_sampling(spec, seed)
        return [response.choices[0].message.content for response in self.client.infer(requests, config)]


def connect_server_backend(server: StageBServerConfig) -> tuple[ServerBackend, str]:
    """A client of `runner.server.base_urls`, once every server answers `/health/`."""
    if not server.base_urls:
        raise ValueError(
            "runner.server.base_urls: runner.engine: server needs at least one rollout server URL"
        )
    token = read_token(server.auth_token_env, "runner.server.auth_token_env")
    client = RolloutClient(
        server.base_urls,
        infer_timeout_s=server.infer_timeout_s,
        auth_token=token,
        tls_ca_file=server.tls_ca_file,
        tls_skip_verify=server.tls_skip_verify,
    )
    try:
        client.wait_healthy(server.wait_healthy_s)
    except TimeoutError as exc:
        client.close()
        raise ValueError(f"runner.server.base_urls: {exc}") from None
    return ServerBackend(client), f"rollouts from {', '.join(server.base_urls)}"
