"""Hugging Face's own progress bars off while stagectl loads or saves a model.

transformers draws a tqdm bar for every weight load ("Loading weights") and shard write ("Writing model
shards"). On a terminal they interleave with stagectl's step lines, in a log file they are carriage-return
noise, and under torchrun every rank draws its own. stagectl prints its own line instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from transformers.utils import logging as hf_logging


@contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """Disable transformers' progress bars inside the block (restored after it if they were on)."""
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
