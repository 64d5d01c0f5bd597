"""Rollouts on CUDA: `rollout-server --engine vllm` serving the tiny Qwen2.5-VL with images (greedy ids equal
transformers' on the same GPU, token for token), a weight sync into vLLM on the GPU, and the embedded
server of a train-ab run on its own device (`rollout_server.devices`, #26: two GPUs), or refused, then run with
`allow_shared_devices`, beside the learner on one."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stagectl.inference.client import RolloutClient, detection_request, to_generation
from stagectl.models.chat import encode_answer_text, encode_prompt
from stagectl.models.generate import PromptInputs, SamplingSpec, generate_batch
from stagectl.models.loading import ModelBundle, load_bundle
from stagectl.server.launcher import ServerProcess
from stagectl.weightsync.client import WeightSyncClient
from stagectl.wire.protocol import RequestConfig
from tests.gpu.helpers import require_gpus, require_vllm_cuda
from tests.integration.helpers import ROOT, read_metrics, run_cli, tiny_train_config, write_config

MODEL = "builtin:tiny-qwen2.5-vl"
INSTRUCTION = "Find every object."
GREEDY = RequestConfig(max_tokens=24, temperature=0.0, return_details=True)
NUM_IMAGES = 6


@dataclass
class Served:
    url: str
    mirror: ModelBundle  # transformers on the same GPU, float32 like the server; weights equal the server's
    images: list[Path]

    def local_greedy(self, index: int) -> list[int]:
        image = Image.open(self.images[index]).convert("RGB")
        p = encode_prompt(self.mirror.tokenizer, self.mirror.image_processor, [image], INSTRUCTION)
        prompt = PromptInputs(p.input_ids, p.mm_token_type_ids, p.pixel_values, p.image_grid_thw)
        (generation,) = generate_batch(
            self.mirror.model,
            [prompt],
            SamplingSpec(max_new_tokens=GREEDY.max_tokens, temperature=0.0),
            stop_token_ids=[self.mirror.end_of_turn_id, int(self.mirror.tokenizer.pad_token_id)],
            pad_token_id=int(self.mirror.tokenizer.pad_token_id),
        )
        return generation.token_ids

    def greedy(self, client: RolloutClient) -> list[list[int]]:
        requests = [detection_request([path], INSTRUCTION) for path in self.images]
        return [to_generation(out).token_ids for out in client.infer(requests, GREEDY)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    python = require_vllm_cuda()
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    images = []
    for k in range(NUM_IMAGES):
        path = root / f"img{k}.png"
        side = (56, 112, 168)[k % 3]  # three grids: three vision token counts
        Image.fromarray(rng.integers(0, 255, (side, side + 28 * (k % 2), 3), dtype=np.uint8)).save(path)
        images.append(path)
    mirror = load_bundle(MODEL, device="cuda")  # builds the cached checkpoint the server then loads
    argv = [str(python), "-m", "stagectl", "rollout-server", "--engine", "vllm", "--port", "0"]  # fmt: skip
    argv += ["--model", MODEL]
    # float32 on both sides (no TF32 in the mirror's patch-embedding conv either): equal greedy ids, not close
    # ones. Eager: the CUDA-graph capture would cost a minute of start-up and changes no result.
    tf32_before, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    for setting in (f"image_roots=[{root}]", "vllm.dtype=float32", "vllm.max_model_len=2048",
                    "vllm.gpu_memory_utilization=0.3", "vllm.enforce_eager=true", "max_batch_size=8"):  # fmt: skip
        argv += ["--set", f"rollout_server.{setting}"]
    server = ServerProcess(argv, cwd=ROOT)
    server.wait_listening(timeout_s=600)
    assert server.url is not None
    yield Served(server.url, mirror, images)
    torch.backends.cudnn.allow_tf32 = tf32_before
    assert server.stop() in (0, -signal.SIGTERM), "\n".join(server.tail)


@pytest.fixture
def client(served: Served) -> Iterator[RolloutClient]:
    with RolloutClient([served.url]) as c:
        c.wait_healthy(timeout_s=60)
        yield c


@pytest.fixture
def pusher(served: Served) -> Iterator[WeightSyncClient]:
    with WeightSyncClient([served.url], chunk_bytes=1 << 22) as p:
        yield p


def test_vllm_greedy_with_images_equals_transformers(served: Served, client: RolloutClient) -> None:
    (version,) = client.versions()
    assert version.engine == "vllm"
    got = served.greedy(client)
    assert got == [served.local_greedy(k) for k in range(NUM_IMAGES)]
    assert sum(len(ids) for ids in got) > NUM_IMAGES * 4  # not trivially short


def test_weight_sync_into_vllm_on_gpu(
    served: Served, client: RolloutClient, pusher: WeightSyncClient
) -> None:
    before = served.greedy(client)
    version = client.versions()[0].version
    model, tok = served.mirror.model, served.mirror.tokenizer
    ids = torch.tensor([encode_answer_text(tok, "red circle blue square green star")], device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):  # a few real steps: the greedy output must move
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
    model.eval()
    local = [served.local_greedy(k) for k in range(NUM_IMAGES)]
    assert local != before
    report = pusher.push_weights(model.state_dict(), version + 1)
    assert report.num_chunks > 1
    assert client.versions()[0].version == version + 1
    assert served.greedy(client) == local  # token for token, every image


def _gpu_memory_used_mib() -> list[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [int(line) for line in out.split()]


def _pids_per_gpu() -> dict[int, set[int]]:
    """GPU index -> the processes holding memory on it (empty sets where a container hides the pids)."""

    def query(what: str) -> list[list[str]]:
        out = subprocess.run(
            ["nvidia-smi", f"--query-{what}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]

    index_of = {uuid: int(index) for index, uuid in query("gpu=index,uuid")}
    found: dict[int, set[int]] = {index: set() for index in index_of.values()}
    for pid, uuid in query("compute-apps=pid,gpu_uuid"):
        if uuid in index_of and pid.isdigit():
            found[index_of[uuid]].add(int(pid))
    return found


def test_embedded_server_runs_on_its_own_device(tmp_path: Path) -> None:
    """Learner on GPU 0 (one rank), embedded server on GPU 1 (`rollout_server.devices: [1]`): memory shows
    up on both, and no process holds memory on both (where nvidia-smi shows the processes)."""
    require_gpus(2)
    out = tmp_path / "run"
    cfg = tiny_train_config(
        tmp_path,
        training={"max_steps": 4, "output_dir": str(out)},
        custom={"extra": {"rollout_matching": {"rollout_backend": "vllm", "vllm": {"mode": "server"}}}},
        stage2_ab={"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "async"}},
        rollout_server={"embedded": True, "devices": [1]},
    )
    baseline = _gpu_memory_used_mib()
    peaks = list(baseline)
    pids: dict[int, set[int]] = {0: set(), 1: set()}
    before = _pids_per_gpu()
    done = threading.Event()

    def watch() -> None:  # the learner holds GPU 0; the server's model must show up on GPU 1 only
        while not done.wait(0.5):
            peaks[:] = [max(a, b) for a, b in zip(peaks, _gpu_memory_used_mib(), strict=True)]
            for index, found in _pids_per_gpu().items():
                if index in pids:
                    pids[index] |= found - before.get(index, set())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_cli("train-ab", str(write_config(tmp_path / "cfg.yaml", cfg)), timeout=300)
    finally:
        done.set()
        watcher.join()
    assert result.returncode == 0, result.stderr[-4000:]
    assert any(r["kind"] == "B" for r in read_metrics(out))
    assert peaks[0] - baseline[0] > 100 and peaks[1] - baseline[1] > 100, (baseline, peaks)
    if pids[0] and pids[1]:  # two processes, each on its own device
        assert not pids[0] & pids[1], pids


def test_one_gpu_server_placement_is_refused_unless_shared_then_runs_beside_the_learner(
    tmp_path: Path,
) -> None:
    """On a one-GPU host (the lent machines have one): `rollout_server.devices: [0]` beside a learner on GPU 0
    is refused naming `allow_shared_devices`; a device id the host lacks is refused before anything starts;
    with `allow_shared_devices: true` the run trains B steps with the learner and the server as two processes
    on GPU 0 (where nvidia-smi shows the processes)."""
    require_gpus(1)
    out = tmp_path / "run"

    def config(**server: object) -> Path:
        cfg = tiny_train_config(
            tmp_path,
            training={"max_steps": 4, "output_dir": str(out)},
            custom={"extra": {"rollout_matching": {"rollout_backend": "vllm", "vllm": {"mode": "server"}}}},
            stage2_ab={"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "async"}},
            rollout_server={"embedded": True, **server},
        )
        return write_config(tmp_path / "cfg.yaml", cfg)

    shared = run_cli("train-ab", str(config(devices=[0])), timeout=120)
    assert shared.returncode != 0
    assert "allow_shared_devices" in shared.stderr and "rollout_server.devices" in shared.stderr, (
        shared.stderr
    )
    assert not (out / "metrics.jsonl").exists()
    if torch.cuda.device_count() == 1:
        missing = run_cli("train-ab", str(config(devices=[1])), timeout=120)
        assert missing.returncode != 0
        assert "rollout_server.devices" in missing.stderr, missing.stderr
        assert "do not exist" in missing.stderr or "not visible" in missing.stderr, missing.stderr
        assert not (out / "metrics.jsonl").exists()

    before = _pids_per_gpu().get(0, set())
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            seen.update(_pids_per_gpu().get(0, set()) - before)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_cli("train-ab", str(config(devices=[0], allow_shared_devices=True)), timeout=300)
    finally:
        done.set()
        watcher.join()
    assert result.returncode == 0, result.stderr[-4000:]
    assert any(r["kind"] == "B" for r in read_metrics(out))
    if seen:  # the container shows the processes: the learner rank and the server, each its own
        assert len(seen) >= 2, seen
