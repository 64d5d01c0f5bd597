"""Do the bench machine's two cores slow each other down? A decode-like load (the tiny Qwen2.5-VL's
`generate`, batch 8, 120 prompt + 96 new tokens) pinned to CPU 1, timed alone and while a training loop
(forward + backward on 2048 tokens) runs pinned to CPU 0 in another process; interleaved, twice.

The async bench's overlap bound assumes each side runs as fast beside the other as step mode measured it
alone; this says how far that holds on the machine. Run: `python -m bench.cross_core`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from stagectl.models.loading import load_bundle

MODEL = "builtin:tiny-qwen2.5-vl"


def decode_times(repeats: int) -> list[float]:
    """Seconds per batch on CPU 1 (the first one, a warm-up, left out)."""
    os.sched_setaffinity(0, [1])
    model = load_bundle(MODEL).model
    ids = torch.randint(10, 1000, (8, 120))  # [batch, prompt tokens]
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            started = time.perf_counter()
            model.generate(  # type: ignore[operator]
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=96,
                min_new_tokens=96,
                do_sample=True,
            )
            times.append(time.perf_counter() - started)
    return times[1:]


def train_forever() -> None:
    os.sched_setaffinity(0, [0])
    model = load_bundle(MODEL).model
    model.train()
    ids = torch.randint(10, 1000, (1, 2048))  # one packed sequence
    while True:
        model(input_ids=ids, labels=ids).loss.backward()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cross_core", description=__doc__)
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # the load it starts itself
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.train:
        train_forever()
    for label in ("alone", "beside training", "alone", "beside training"):
        trainer = None
        if label == "beside training":
            trainer = subprocess.Popen([sys.executable, "-m", "bench.cross_core", "--train"])
            time.sleep(8)  # past its model load
        times = decode_times(5)
        if trainer is not None:
            trainer.kill()
            trainer.wait()
        print(
            f"{label}: decode batch s {' '.join(f'{t:.3f}' for t in times)}, median {sorted(times)[2]:.3f}, "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
