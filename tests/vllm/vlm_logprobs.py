"""Run by the vLLM environment's interpreter for `test_vllm_vlm.py`: greedy generations of a vision-language
model with images through `vllm.LLM` (started exactly as the `vllm` engine starts it), with each generated
token's log-probability (`SamplingParams(logprobs=0)`: the chosen token's own).

`python -m tests.vllm.vlm_logprobs MODEL_DIR MAX_TOKENS IMAGE.png TEXT [IMAGE.png TEXT ...]` prints one JSON
object per line: `{"prompt_token_ids": [...], "token_ids": [...], "logprobs": [...]}`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from PIL import Image

from stagectl.config.rollout import VllmEngineArgs
from stagectl.engines.vllm import _start_llm
from stagectl.models.chat import chat_template_ids
from stagectl.models.loading import checkpoint_stop_ids, load_tokenizer


def main(argv: list[str]) -> None:
    path, max_tokens, pairs = Path(argv[0]), int(argv[1]), argv[2:]
    tokenizer = load_tokenizer(str(path), add_coord_tokens=False)
    _, stop_ids = checkpoint_stop_ids(path, tokenizer)
    args = VllmEngineArgs(kv_cache_mb=64, max_model_len=1024)
    llm = _start_llm(path, args, "float32", max_batch_size=len(pairs) // 2)

    from vllm import SamplingParams

    prompts = []
    for image, text in zip(pairs[::2], pairs[1::2], strict=True):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        prompts.append(
            {
                "prompt_token_ids": chat_template_ids(tokenizer, messages),
                "multi_modal_data": {"image": [Image.open(image).convert("RGB")]},
            }
        )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, stop_token_ids=stop_ids)
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        record = {
            "prompt_token_ids": list(output.prompt_token_ids),
            "token_ids": list(completion.token_ids),
            "logprobs": logprobs,
        }
        print(json.dumps(record), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
