"""`runner.engine: server`: rollouts from running rollout servers through `inference.client.RolloutClient`.

The Stage-B processes hold no model. Each `judge` call is one `infer` over the rank's shard (the client
spreads it over the servers, retries and splits); request i is sampled with `spec.seed + i`.
"""

from __future__ import annotations

from collections.abc import Sequence

from stagectl.config.plan import ServerList
from stagectl.config.sampling import SamplingSpec
from stagectl.console import say
from stagectl.inference.client import RolloutClient
from stagectl.stage_b.engine import JudgeRequest, ReflectRequest
from stagectl.stage_b.prompts import Message as ChatMessage
from stagectl.wire.protocol import InferRequest, Message, RequestConfig


class ServerBackend:
    def __init__(self, client: RolloutClient) -> None:
        self.client = client

    def judge(self, requests: Sequence[JudgeRequest], spec: SamplingSpec, seed: int) -> list[str]:
        return self._infer([r.messages for r in requests], spec, seed)

    def reflect(self, request: ReflectRequest, spec: SamplingSpec, seed: int) -> str:
        return self._infer([request.messages], spec, seed)[0]

    def close(self) -> None:
        self.client.close()

    def _infer(self, conversations: Sequence[list[ChatMessage]], spec: SamplingSpec, seed: int) -> list[str]:
        requests = [
            InferRequest(messages=[Message(role=m["role"], content=m["content"]) for m in messages])  # type: ignore[arg-type]
            for messages in conversations
        ]
        config = RequestConfig.from_sampling(spec, seed)
        return [response.choices[0].message.content for response in self.client.infer(requests, config)]


def connect_server_backend(servers: ServerList) -> tuple[ServerBackend, str]:
    """A client of `servers` (`runner.server`), once every server answers `/health/`."""
    client = RolloutClient.for_servers(servers)  # a missing token is reported under servers.token_key
    try:
        client.wait_healthy(
            servers.wait_healthy_s,
            on_wait=lambda line: say("stage-b", line),
            wait_key=servers.wait_healthy_key,
        )
    except TimeoutError as exc:
        client.close()
        raise ValueError(f"{servers.key}.base_urls: {exc}") from None
    return ServerBackend(client), f"rollouts from {', '.join(servers.base_urls)}"
