"""What every benchmark case shares: the model, the data, timing and memory measurement.

A case is a module-level function run on every rank of a fresh spawned world (so peak RSS belongs to
that case alone). It returns per-rank measurements; the suite interleaves cases and repeats.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from paratrain.data import DataParallelSampler, TokenWindows, default_collate, load_corpus
from paratrain.models import GPT
from paratrain.monitor import peak_rss_bytes

BENCH_MODEL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=8, d_model=256, bias=False)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)


def bench_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT("gpt-small", **{**BENCH_MODEL, **overrides})


def local_batches(micro_batch: int, dp_size: int, dp_rank: int, accumulation: int = 1, seed: int = 0,
                  seq_len: int = BENCH_MODEL["seq_len"]):
    """The same micro-batches paratrain's own sampler would give this dp rank (so losses are comparable)."""
    train, _ = load_corpus()
    data = TokenWindows(train, seq_len)
    sampler = DataParallelSampler(len(data), micro_batch, dp_size, dp_rank, accumulation, seed=seed)
    while True:
        yield default_collate([data[i] for i in sampler.next_indices()])


@dataclass
class Timer:
    """Wall time per optimizer step, each step started in lock-step across ranks (a barrier)."""

    warmup: int
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def measure(self, steps: int, one_step) -> None:
        for i in range(self.warmup + steps):
            dist.barrier()
            tic = time.perf_counter()
            loss = one_step()
            elapsed = time.perf_counter() - tic
            self.losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))
            if i >= self.warmup:
                self.times.append(elapsed)

    def result(self, **extra) -> dict:
        return {"median_step_s": statistics.median(self.times), "step_times": self.times, "losses": self.losses,
                "peak_rss": peak_rss_bytes(), **extra}
