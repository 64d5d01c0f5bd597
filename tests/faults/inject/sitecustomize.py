"""Fault injection for the fault suite: put this directory first on `PYTHONPATH` and every Python
process of a run (CLI, torchrun agent, learner ranks, rollout server) imports it at start-up.

`STAGECTL_FAULT_DIR=D`: each process records itself in `D/pid-<pid>.json` (pid, start time from
/proc, argv, rank), so a test can prove afterwards that no process of the run is left.
`STAGECTL_FAULT=SPEC` arms one fault (it records `D/fault-<pid>.json` with the wall time when it fires):

- `raise_in_micro_step:RANK:CALL` - the CALL-th forward/backward (`PackRunner.run_batch`, 1-based) on
  learner rank RANK raises `RuntimeError` (a rank failing mid-step, after the others entered it);
- `kill_in_checkpoint:STEP` - the learner SIGKILLs itself while writing checkpoint STEP (model files
  already written to the temp dir, `optimizer.pt` not yet);
- `kill_at_step:STEP` - learner rank 0 SIGKILLs the learner's process group (torchrun and every rank)
  as optimizer step STEP (0-based) begins: the job dies between checkpoints, the CLI front survives;
- `kill_in_push:SYNC` - learner rank 0 SIGKILLs the learner's process group inside its SYNC-th async
  weight push (1-based): the sync fence closed, the prefetcher's next burst waiting on it;
- `wait_for_packs:SECONDS` - async learner ranks whose step wants Channel-B wait (up to SECONDS, together)
  until every rank's queue holds a B step's packs of one common eligible version, so no B step turns into A
  for lack of packs; and before each weight sync every rank waits (up to SECONDS) until its prefetcher
  wants no more packs of the current version, so every burst pacing asks for at a version is generated
  at that version, not at the next one when the prefetcher thread runs late
  (makes the channel of every step, and so what is trained, independent of timing);
- `kill_in_sync:SYNC:CHUNK` - the rollout server SIGKILLs itself when chunk CHUNK (0-based) of the
  SYNC-th weight sync it sees (1-based) arrives, i.e. half-way through the push;
- `kill_in_broadcast:CALL` - the rollout server SIGKILLs itself when its CALL-th weight-group broadcast
  (1-based, over every `transport: collective` sync it takes) begins: a server dying mid-broadcast;
- `kill_in_infer:CALL` - the rollout server SIGKILLs itself inside its CALL-th `/infer/` (1-based),
  with the request accepted and not yet answered;
- `record_raise:MODULE:CLASS:METHOD` - no fault of its own: records when MODULE.CLASS.METHOD raises
  (to time an error the code under test raises itself);
- `stop_in_micro_step:RANK:CALL` - learner rank RANK freezes itself (SIGSTOP) in its CALL-th
  forward/backward: alive, holding its sockets, answering nothing (a hung GPU or a stuck NFS read);
- `stop_in_push:SYNC` - learner rank 0 freezes itself (SIGSTOP) inside its SYNC-th async weight push;
- `resume_view:RANK` - on learner rank RANK, every `checkpoint-*` directory looks complete (a
  node-local or lagging view of the output directory that lists a checkpoint still being written);
- `log_stream:STREAM` - every `ShardedSampler.take` of stream STREAM appends the indices it returns to
  `D/stream-STREAM-rank<R>.jsonl` (what each rank consumed, to compare runs);
- `slow_prefetch:RANK:SECONDS` - the async prefetcher of rank RANK sleeps SECONDS before each burst;
- `raise_in_prefetch:RANK` - the async prefetcher of rank RANK raises in its first burst;
- `slow_infer:MS` - the rollout server sleeps MS milliseconds in every `/infer/` before generating;
- `raise_in_judge:RANK:BATCH` - Stage-B rank RANK raises while its rule engine judges global batch BATCH.

Several faults are armed at once with `;` between their specs.

Nothing here runs unless those variables are set; the patches are applied when the target module is
first imported (an import hook), so a process that never imports it pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

FAULT_DIR = os.environ.get("STAGECTL_FAULT_DIR")
SPEC = os.environ.get("STAGECTL_FAULT", "")


def _start_time_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat: start time in clock ticks since boot (tells a reused pid apart)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def _record(kind: str, **fields: Any) -> None:
    assert FAULT_DIR is not None
    pid = os.getpid()
    entry = {"pid": pid, "time": time.time(), "rank": os.environ.get("RANK"), **fields}
    path = Path(FAULT_DIR) / f"{kind}-{pid}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, path)


def _fire(description: str) -> None:
    _record("fault", what=description)
    print(f"fault injection: {description}", file=sys.stderr, flush=True)


# --- the faults ----------------------------------------------------------------------------------


def _raise_in_micro_step(module: ModuleType, rank: str, call: str) -> None:
    if os.environ.get("RANK", "0") != rank:
        return
    runner = module.PackRunner
    original = runner.run_batch
    calls = [0]

    def run_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == int(call):
            _fire(f"rank {rank} raises in forward/backward call {call}")
            raise RuntimeError(f"injected fault: rank {rank} failed in forward/backward call {call}")
        return original(self, *args, **kwargs)

    runner.run_batch = run_batch


def _kill_in_checkpoint(module: ModuleType, step: str) -> None:
    torch = module.torch
    original = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        path = Path(str(f))
        if path.name == "optimizer.pt" and path.parent.name.startswith(f".tmp-checkpoint-{step}-"):
            _fire(f"SIGKILL while writing checkpoint {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(obj, f, *args, **kwargs)

    torch.save = save


def _kill_learner_group(description: str) -> None:
    _fire(description)
    os.killpg(os.getpgrp(), signal.SIGKILL)  # torchrun's session: the agent and every rank


def _kill_at_step(module: ModuleType, step: str) -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    cls = module.Trainer
    original = cls.train_step

    def train_step(self: Any, at: int) -> Any:
        if at == int(step):
            _kill_learner_group(f"SIGKILL of the learner at step {step}")
        return original(self, at)

    cls.train_step = train_step


def _on_push(module: ModuleType, sync: str, act: Callable[[], None]) -> None:
    """On learner rank 0, `act()` inside the SYNC-th weight push (1-based), before it sends anything."""
    if os.environ.get("RANK", "0") != "0":
        return
    cls = module.WeightPublisher
    original = cls._push
    calls = [0]

    def push(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == int(sync):
            act()
        return original(self, *args, **kwargs)

    cls._push = push


def _kill_in_push(module: ModuleType, sync: str) -> None:
    _on_push(module, sync, lambda: _kill_learner_group(f"SIGKILL of the learner inside weight push {sync}"))


def _wait_for_packs(module: ModuleType, seconds: str) -> None:
    cls = module.AsyncChannelB
    original = cls.decide

    def decide(self: Any, step: int, policy_wants_b: bool) -> Any:
        from stagectl import dist

        # the gate needs `gas` packs of ONE version on EVERY rank: wait until the ranks' minimum has them
        # (each rank waiting for its own packs is not enough: two ranks may hold different versions)
        deadline = time.monotonic() + float(seconds)
        while policy_wants_b:
            _, counts = self.queue.eligible_counts()  # the same versions on every rank
            if any(count >= self.gas for count in dist.all_reduce_ints(counts, "min")):
                break
            give_up = time.monotonic() >= deadline or self.prefetcher.error() is not None
            if dist.all_reduce_ints([int(give_up)], "max")[0]:
                break
            time.sleep(0.02)
        return original(self, step, policy_wants_b)

    cls.decide = decide
    original_after_update = cls.after_update

    def after_update(self: Any, num_updates: int) -> Any:
        if num_updates % self.queue_plan.sync_every_steps == 0:  # a sync comes: finish this version's bursts
            deadline = time.monotonic() + float(seconds)
            while self.prefetcher._packs_wanted() > 0 and self.prefetcher.error() is None:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
        return original_after_update(self, num_updates)

    cls.after_update = after_update


def _kill_in_broadcast(module: ModuleType, call: str) -> None:
    cls = module.WeightGroup
    original = cls.broadcast
    calls = [0]

    def broadcast(self: Any, tensor: Any) -> None:
        calls[0] += 1
        if calls[0] == int(call):
            _fire(f"server SIGKILL at weight-group broadcast {call}")
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, tensor)

    cls.broadcast = broadcast


def _kill_in_sync(module: ModuleType, sync: str, chunk: str) -> None:
    # `begin_chunk` opens every chunk streamed over http
    cls = module.HttpReceiver
    original = cls.begin_chunk
    seen: list[str] = []

    def begin_chunk(self: Any, sync_id: str, chunk_index: int, *args: Any, **kwargs: Any) -> Any:
        if sync_id not in seen:
            seen.append(sync_id)
        if len(seen) == int(sync) and chunk_index == int(chunk):
            _fire(f"server SIGKILL at chunk {chunk} of weight sync {sync}")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, sync_id, chunk_index, *args, **kwargs)

    cls.begin_chunk = begin_chunk


def _kill_in_infer(module: ModuleType, call: str) -> None:
    cls = module.RolloutService
    original = cls.infer
    calls = [0]

    def infer(self: Any, body: Any) -> Any:
        calls[0] += 1
        if calls[0] == int(call):
            _fire(f"server SIGKILL inside /infer/ call {call}")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, body)

    cls.infer = infer


def _record_raise(module: ModuleType, class_name: str, method_name: str) -> None:
    cls = vars(module)[class_name]
    original = vars(cls)[method_name]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except BaseException as exc:
            _fire(f"{class_name}.{method_name} raised {type(exc).__name__}: {exc}")
            raise

    setattr(cls, method_name, wrapper)


def _stop_in_micro_step(module: ModuleType, rank: str, call: str) -> None:
    if os.environ.get("RANK", "0") != rank:
        return
    runner = module.PackRunner
    original = runner.run_batch
    calls = [0]

    def run_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == int(call):
            _fire(f"rank {rank} freezes (SIGSTOP) in forward/backward call {call}")
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(self, *args, **kwargs)

    runner.run_batch = run_batch


def _stop_in_push(module: ModuleType, sync: str) -> None:
    def freeze() -> None:
        _fire(f"rank 0 freezes (SIGSTOP) inside weight push {sync}")
        os.kill(os.getpid(), signal.SIGSTOP)

    _on_push(module, sync, freeze)


def _resume_view(module: ModuleType, rank: str) -> None:
    if os.environ.get("RANK", "0") != rank:
        return

    def list_checkpoints(output_dir: Path) -> list[Path]:
        found = []
        for child in output_dir.iterdir() if output_dir.is_dir() else []:
            match = module.CHECKPOINT_RE.match(child.name)
            if match:
                found.append((int(match.group(1)), child))
        _fire(f"rank {rank} lists checkpoints with a naive view")
        return [path for _, path in sorted(found)]

    module.list_checkpoints = list_checkpoints


def _log_stream(module: ModuleType, stream: str) -> None:
    cls = module.ShardedSampler
    original = cls.take

    def take(self: Any, count: int) -> Any:
        out = original(self, count)
        if self.stream == stream:
            assert FAULT_DIR is not None
            path = Path(FAULT_DIR) / f"stream-{stream}-rank{os.environ.get('RANK', '0')}.jsonl"
            with path.open("a") as handle:
                handle.write(json.dumps(out) + "\n")
        return out

    cls.take = take


def _slow_prefetch(module: ModuleType, rank: str, seconds: str) -> None:
    if os.environ.get("RANK", "0") != rank:
        return
    cls = module.Prefetcher
    original = cls._burst

    def burst(self: Any, num_packs: int, **kwargs: Any) -> Any:
        time.sleep(float(seconds))
        return original(self, num_packs, **kwargs)

    cls._burst = burst


def _raise_in_prefetch(module: ModuleType, rank: str) -> None:
    if os.environ.get("RANK", "0") != rank:
        return

    def burst(self: Any, num_packs: int, **kwargs: Any) -> Any:
        _fire(f"rank {rank} prefetcher raises")
        raise RuntimeError(f"injected prefetch fault on rank {rank}")

    module.Prefetcher._burst = burst


def _slow_infer(module: ModuleType, ms: str) -> None:
    cls = module.RolloutService
    original = cls.infer

    def infer(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(float(ms) / 1000.0)
        return original(self, *args, **kwargs)

    cls.infer = infer


def _raise_in_judge(module: ModuleType, rank: str, batch: str) -> None:
    if os.environ.get("RANK", "0") != rank:
        return
    cls = module.RulesBackend
    original = cls.judge

    def judge(self: Any, requests: Any, *args: Any, **kwargs: Any) -> Any:
        if any(request.batch_index == int(batch) for request in requests):
            _fire(f"rank {rank} raises judging global batch {batch}")
            raise RuntimeError(f"injected fault on rank {rank} in global batch {batch}")
        return original(self, requests, *args, **kwargs)

    cls.judge = judge


FAULTS: dict[str, tuple[str, Callable[..., None]]] = {
    "raise_in_micro_step": ("stagectl.learner.packs", _raise_in_micro_step),
    "kill_in_checkpoint": ("stagectl.learner.checkpoint", _kill_in_checkpoint),
    "kill_at_step": ("stagectl.learner.loop", _kill_at_step),
    "kill_in_push": ("stagectl.learner.channel_b.publisher", _kill_in_push),
    "wait_for_packs": ("stagectl.learner.channel_b.async_mode", _wait_for_packs),
    "kill_in_sync": ("stagectl.weightsync.http", _kill_in_sync),
    "kill_in_broadcast": ("stagectl.weightsync.collective", _kill_in_broadcast),
    "kill_in_infer": ("stagectl.server.service", _kill_in_infer),
    "stop_in_micro_step": ("stagectl.learner.packs", _stop_in_micro_step),
    "stop_in_push": ("stagectl.learner.channel_b.publisher", _stop_in_push),
    "resume_view": ("stagectl.learner.checkpoint", _resume_view),
    "log_stream": ("stagectl.data.sampler", _log_stream),
    "slow_prefetch": ("stagectl.learner.channel_b.prefetcher", _slow_prefetch),
    "raise_in_prefetch": ("stagectl.learner.channel_b.prefetcher", _raise_in_prefetch),
    "slow_infer": ("stagectl.server.service", _slow_infer),
    "raise_in_judge": ("stagectl.stage_b.engine_rules", _raise_in_judge),
}


# --- the import hook -----------------------------------------------------------------------------


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `target` with the normal machinery, executes it, then applies `patch(module, *args)`."""

    def __init__(self, target: str, patch: Callable[..., None], args: Sequence[str]) -> None:
        self.target, self.patch, self.args = target, patch, list(args)
        self._loader: Any = None

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self.patch(module, *self.args)


def _install() -> None:
    if FAULT_DIR is None:
        return
    _record("pid", start_ticks=_start_time_ticks(os.getpid()), argv=sys.argv, ppid=os.getppid())
    for spec in filter(None, SPEC.split(";")):
        name, *args = spec.split(":")
        if name == "record_raise":
            target, args = args[0], args[1:]
            sys.meta_path.insert(0, _PatchAfterImport(target, _record_raise, args))
            continue
        target, patch = FAULTS[name]
        sys.meta_path.insert(0, _PatchAfterImport(target, patch, args))


_install()
