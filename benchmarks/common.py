"""What every benchmark case shares: the model, the data, the optimizer, timing and memory measurement, and
the fairness check that refuses to compare cases set up differently.

A case is a module-level function run on every rank of a fresh spawned world (so peak RSS belongs to
that case alone). It returns per-rank measurements; the suite interleaves cases and repeats.

Fairness: every case builds its optimizer here (torch's AdamW with the fused kernel, the one paratrain's
optimizer builder picks on CPU and CUDA, `paratrain/optim.py`), its model with `bench_model` and its data
with `LocalBatches`. Before its first timed step a case's `Timer` records what it actually built (optimizer
class and flags, threads, dtype, seeds) and refuses to time a case that differs from `expected_setup()`;
the suite checks the recorded setups of all its cases against each other again before it compares them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from paratrain.data import DataParallelSampler, TokenWindows, default_collate, load_corpus
from paratrain.engine.monitor import peak_rss_bytes
from paratrain.models import GPT

BENCH_MODEL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=8, d_model=256, bias=False)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
FUSED = True  # one kernel over all tensors: what paratrain's AdamW runs; the default torch AdamW loops per tensor
SEED = 0  # the model's initialization and the data order
THREADS = 1  # torch threads per rank (the spawned worlds set it)
DTYPE = torch.float32
OPTIMIZER_FIELDS = ("fused", "foreach", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


# ---- what every case builds -----------------------------------------------------------------------------------
def bench_model(seed: int = SEED, **overrides) -> GPT:
    torch.manual_seed(seed)
    model = GPT("gpt-small", **{**BENCH_MODEL, **overrides})
    model.init_seed = seed  # recorded by record_setup
    return model


def torch_adamw(params) -> torch.optim.AdamW:
    """The optimizer of every torch peer (DDP, FSDP2, DTensor TP, pipelining) and of the references."""
    return torch.optim.AdamW(params, **ADAMW, fused=FUSED)


def paratrain_optimizer() -> dict:
    """The `optimizer` config section of every paratrain case: the same AdamW, the fused kernel asked for
    explicitly (paratrain's default on CPU/CUDA, but a benchmark should not depend on a default)."""
    return {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]), "fused": FUSED}}


def deepspeed_optimizer() -> dict:
    """DeepSpeed's `optimizer` section for the same AdamW: `torch_adam` makes DeepSpeed build torch's AdamW
    (its own FusedAdam needs a compiled op) and pass the remaining params, `fused` among them, to it."""
    return {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]), "torch_adam": True, "fused": FUSED}}


class LocalBatches:
    """The same micro-batches paratrain's own sampler would give this dp rank (so losses are comparable)."""

    def __init__(self, micro_batch: int, dp_size: int, dp_rank: int, accumulation: int = 1, seed: int = SEED,
                 seq_len: int | None = None):
        train, _ = load_corpus()
        self.data = TokenWindows(train, seq_len or BENCH_MODEL["seq_len"])
        self.sampler = DataParallelSampler(len(self.data), micro_batch, dp_size, dp_rank, accumulation, seed=seed)
        self.seed = seed  # recorded by record_setup

    def __iter__(self):
        return self

    def __next__(self):
        return default_collate([self.data[i] for i in self.sampler.next_indices()])


# ---- the fairness record and check ------------------------------------------------------------------------------
class UnfairComparison(ValueError):
    """Two cases of one comparison were set up differently (optimizer, threads, dtype or seeds)."""


def innermost_optimizer(optimizer):
    """The torch optimizer that does the update: DeepSpeed's ZeRO wrappers keep it in `.optimizer`."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def record_optimizer(optimizer) -> dict:
    """Class and flags of the optimizer as built; a flag whose param groups disagree is the list of values."""
    opt = innermost_optimizer(optimizer)
    out = {"class": f"{type(opt).__module__}.{type(opt).__qualname__}"}
    for name in OPTIMIZER_FIELDS:
        values = [_plain(group.get(name)) for group in opt.param_groups]
        out[name] = values[0] if all(v == values[0] for v in values) else values
    return out


def record_setup(optimizer, model: nn.Module, batches: LocalBatches) -> dict:
    """Everything that must be equal between the cases of a comparison, read from what the case built."""
    opt = innermost_optimizer(optimizer)
    tensors = [*model.parameters(), *(p for g in opt.param_groups for p in g["params"])]
    return {"optimizer": record_optimizer(opt), "threads": torch.get_num_threads(),
            "dtype": " ".join(sorted({str(t.dtype) for t in tensors})),
            "seed": {"model": getattr(model, "init_seed", None), "data": batches.seed}}


def expected_setup() -> dict:
    """The setup of a torch peer built by this module: what every case must have recorded."""
    model = nn.Linear(1, 1, dtype=DTYPE)
    model.init_seed = SEED
    return {"optimizer": record_optimizer(torch_adamw(model.parameters())), "threads": THREADS,
            "dtype": str(DTYPE), "seed": {"model": SEED, "data": SEED}}


def _differences(want, got, path: str = "") -> list[tuple[str, object, object]]:
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for key in sorted(set(want) | set(got), key=str):
            out += _differences(want.get(key), got.get(key), f"{path}.{key}" if path else str(key))
        return out
    return [] if want == got else [(path, want, got)]


def check_same_setup(setups: dict[str, dict | None]) -> None:
    """Refuse a comparison whose cases differ: raise naming the first differing case and every differing field
    (against the first case given). A case that recorded nothing is refused too."""
    (first, want), *rest = setups.items()
    for case, got in [(first, want), *rest]:
        if got is None:
            raise UnfairComparison(f"case {case!r} recorded no setup: build its Timer with "
                                   f"record_setup(optimizer, model, batches) from benchmarks.common")
    for case, got in rest:
        diffs = _differences(want, got)
        if diffs:
            fields = "; ".join(f"{p} is {g!r}, not {w!r}" for p, w, g in diffs)
            raise UnfairComparison(
                f"case {case!r} is not set up like {first!r}: {fields}. Build every case's optimizer with "
                f"benchmarks.common (torch_adamw, paratrain_optimizer, deepspeed_optimizer), its model with "
                f"bench_model and its data with LocalBatches, on {THREADS} thread(s) in {DTYPE}")


CURRENT_CASE = "this case"  # set by run_case in each rank of the case's world, for the refusal's message
# When a list: Timer.measure checks the case's setup and hands its one-step function here instead of timing it
# (benchmarks/overhead_paired.py builds two cases in one world and alternates their steps).
STEP_SINK: list | None = None


def run_case(name: str, fn, *args, **kwargs):
    """Run one benchmark case `fn` on this rank under its name (a spawned world runs this)."""
    global CURRENT_CASE
    CURRENT_CASE = name
    return fn(*args, **kwargs)


# ---- timing -------------------------------------------------------------------------------------------------
@dataclass
class Timer:
    """Wall time per optimizer step, each step started in lock-step across ranks (a barrier). `setup` is the
    case's `record_setup(...)`: checked against `expected_setup()` before the first step, kept in the result."""

    warmup: int
    setup: dict
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def measure(self, steps: int, one_step) -> None:
        check_same_setup({"benchmarks.common.expected_setup()": expected_setup(), CURRENT_CASE: self.setup})
        if STEP_SINK is not None:
            STEP_SINK.append(one_step)
            return
        for i in range(self.warmup + steps):
            dist.barrier()
            tic = time.perf_counter()
            loss = one_step()
            elapsed = time.perf_counter() - tic
            self.losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))
            if i >= self.warmup:
                self.times.append(elapsed)

    def result(self, **extra) -> dict:
        median = statistics.median(self.times) if self.times else None  # none with steps=0 (a setup check)
        return {"median_step_s": median, "step_times": self.times, "losses": self.losses,
                "peak_rss": peak_rss_bytes(), "setup": self.setup, **extra}
