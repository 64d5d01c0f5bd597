"""swift's side of the interop tier. Runs in the ms-swift environment (`.venv-interop`), never in stagectl's:
it imports ms-swift's own classes and nothing of stagectl.

    python swift_side.py client URL   < cases.json  > results.json
        Each case `{"requests": [RolloutInferRequest kwargs], "request_config": RequestConfig kwargs}`
        is sent by swift's `VLLMInferClient.infer` (its dataclasses -> `asdict` -> POST /infer/ -> its
        parser); prints one result per case: `{"items": [...]}` or `{"error": "..."}`.
    python swift_side.py parse  < items.json  > kinds.json
        How swift's client parses each answer item (its own code: `RolloutOutput`, else
        `ChatCompletionResponse(**item)`): `RolloutOutput`, `ChatCompletionResponse (choices left as dicts)`
        or `refused: <error>`.
    python swift_side.py serve rollout|deploy
        A server answering `/infer/` with swift's own models: `RolloutOutput` (what `swift rollout`
        answers) or `ChatCompletionResponse` (what `swift deploy` answers). Prints `listening on URL`.
"""

import json
import socket
import sys
from dataclasses import asdict
from typing import Any


def _client(url: str) -> None:
    from swift.infer_engine.protocol import (
        ChatCompletionResponse,
        RequestConfig,
        RolloutInferRequest,
        RolloutOutput,
    )
    from swift.rlhf_trainers import vllm_client

    # The client's constructor insists on vLLM being importable (it is an inference-only client: the
    # check is for its weight-sync sibling); the /infer/ code path does not touch vLLM.
    vllm_client.is_vllm_available = lambda: True
    client = vllm_client.VLLMInferClient(base_urls=[url], connection_timeout=30.0)
    results: list[dict[str, Any]] = []
    for case in json.load(sys.stdin):
        requests = [RolloutInferRequest(**kwargs) for kwargs in case["requests"]]
        config = RequestConfig(**case.get("request_config", {}))
        try:
            parsed = client.infer(requests, config, use_tqdm=False)
        except Exception as exc:  # reported to the test, which asserts on it
            results.append({"error": str(exc)})
            continue
        items = []
        for out in parsed:
            if isinstance(out, RolloutOutput):
                response, kind = out.response, "RolloutOutput"
                extra = {
                    "rollout_infos": out.rollout_infos,
                    "response_token_ids": out.response_token_ids,
                    "rollout_logprobs": out.rollout_logprobs,
                }
            else:
                assert isinstance(out, ChatCompletionResponse)
                response, kind, extra = out, "ChatCompletionResponse", {}
            choice = response.choices[0]
            # attribute access, as swift's trainer does: a dict where a dataclass belongs would fail here
            items.append(
                {
                    "type": kind,
                    "id": response.id,
                    "content": choice.message.content,
                    "finish_reason": choice.finish_reason,
                    "token_ids": choice.token_ids,
                    "logprobs": choice.logprobs,
                    "prompt_token_ids": response.prompt_token_ids,
                    "completion_tokens": response.usage.completion_tokens,
                    **extra,
                }
            )
        results.append({"items": items})
    json.dump(results, sys.stdout)


def _parse() -> None:
    from pydantic import ValidationError
    from swift.infer_engine.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        RolloutOutput,
    )

    kinds = []
    for item in json.load(sys.stdin):
        try:
            out = RolloutOutput.model_validate(item)
            assert isinstance(out.response.choices[0], ChatCompletionResponseChoice)
            kinds.append("RolloutOutput")
            continue
        except ValidationError:
            pass
        try:
            flat = ChatCompletionResponse(**item)
        except TypeError as exc:
            kinds.append(f"refused: {exc}")
            continue
        typed = isinstance(flat.choices[0], ChatCompletionResponseChoice)
        kinds.append("ChatCompletionResponse" + ("" if typed else " (choices left as dicts)"))
    json.dump(kinds, sys.stdout)


def _serve(shape: str) -> None:
    import uvicorn
    from fastapi import FastAPI, Request
    from swift.infer_engine.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
        RolloutOutput,
        UsageInfo,
    )

    app = FastAPI()

    @app.get("/health")
    @app.get("/health/")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/infer/", response_model=None)
    async def infer(request: Request) -> list[Any]:
        body = await request.json()
        details = bool((body.get("request_config") or {}).get("return_details"))
        out: list[Any] = []
        for i, item in enumerate(body["infer_requests"]):
            content = item["messages"][-1]["content"]
            text = content if isinstance(content, str) else "".join(c.get("text") or "" for c in content)
            prompt_ids = list(text.encode())
            reply = f"swift {i}: {text}"
            ids = list(reply.encode())
            response = ChatCompletionResponse(
                model="swift-echo",
                choices=[
                    ChatCompletionResponseChoice(
                        index=0,
                        message=ChatMessage(role="assistant", content=reply),
                        finish_reason="stop",
                        token_ids=ids if details else None,
                    )
                ],
                usage=UsageInfo(len(prompt_ids), len(ids), len(prompt_ids) + len(ids)),
                prompt_token_ids=prompt_ids if details else None,
            )
            out.append(RolloutOutput(response=response) if shape == "rollout" else asdict(response))
        return out

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    if sys.argv[1] == "client":
        _client(sys.argv[2])
    elif sys.argv[1] == "parse":
        _parse()
    elif sys.argv[1] == "serve":
        _serve(sys.argv[2])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
