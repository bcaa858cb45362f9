"""Run the cases: each in a fresh world of spawned processes (so peak RSS belongs to that case alone).

On every rank: build the GPT from one seed, train `warmup + steps` optimizer steps on the embedded corpus,
and measure what this rank holds (`engine.memory_stats()`, exact), what it communicates per optimizer
step on each axis (`engine.comm_stats()`, exact, the step's bookkeeping scalars left out:
`comm.stats.BOOKKEEPING_TAGS`), the step time (each step started together after a barrier) and the process's
peak RSS.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from paratrain.bench.cases import GLOBAL_BATCH, MODELS, Case
from paratrain.comm.stats import BOOKKEEPING_TAGS


def _model(model: str):
    from paratrain.models import GPT

    torch.manual_seed(0)
    return GPT("gpt-small", **MODELS[model])


def _data(model: str):
    from paratrain.data import TokenWindows, load_corpus

    train, _ = load_corpus()
    return TokenWindows(train, MODELS[model]["seq_len"])


def _timed_steps(total: int, warmup: int, one_step) -> tuple[list[float], list[float]]:
    losses, times = [], []
    for i in range(total):
        dist.barrier()
        tic = time.perf_counter()
        losses.append(float(one_step()))
        if i >= warmup:
            times.append(time.perf_counter() - tic)
    return losses, times


def engine_case(case: Case, model: str, steps: int, warmup: int) -> dict:
    """One rank of an engine case."""
    from paratrain.api import initialize
    from paratrain.engine.monitor import peak_rss_bytes

    net = _model(model)
    params = sum(p.numel() for p in net.parameters())  # before parallelizing: TP and PP split in place
    engine, _, loader, _ = initialize(model=net, config=case.config(), training_data=_data(model))
    warm, _ = _timed_steps(warmup, warmup, lambda: engine.train_batch(loader))
    engine.comm_stats(reset=True)
    losses, times = _timed_steps(steps, 0, lambda: engine.train_batch(loader))
    comm: dict[str, dict[str, float]] = {}
    for axis, ops in engine.comm_stats(by_tag=True).items():
        for op, tags in ops.items():
            moved = sum(c["bytes"] for tag, c in tags.items() if tag not in BOOKKEEPING_TAGS)
            if moved:
                comm.setdefault(axis, {})[op] = moved / steps
    return {"state": engine.memory_stats()["total"], "comm": comm, "step_s": statistics.median(times),
            "losses": warm + losses, "rss": peak_rss_bytes(), "params": params}


def threads_case(case: Case, model: str, steps: int, warmup: int, threads: int) -> dict:
    """The one-process DP case: `threads` replicas on CPU "devices", gradients summed by autograd."""
    from paratrain.config import OptimizerConfig
    from paratrain.data import DataParallelSampler, default_collate
    from paratrain.engine.monitor import peak_rss_bytes
    from paratrain.optim import build_optimizer
    from paratrain.parallel.dp.base import optimizer_state_tensors, tensor_bytes
    from paratrain.parallel.dp.dp import DataParallel

    net = _model(model)
    wrapped = DataParallel(net, devices=["cpu"] * threads)
    config = case.config()
    optimizer = build_optimizer(OptimizerConfig(**config["optimizer"]), net.parameters())
    data = _data(model)
    sampler = DataParallelSampler(len(data), GLOBAL_BATCH, 1, 0, seed=config["seed"])

    def step() -> torch.Tensor:
        x, y = default_collate([data[i] for i in sampler.next_indices()])
        loss = wrapped(x, y).mean()  # one loss per replica, each the mean over its equal share
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), config["gradient_clipping"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.detach()

    losses, times = _timed_steps(warmup + steps, warmup, step)
    state = tensor_bytes(net.parameters()) + tensor_bytes(p.grad for p in net.parameters()) + \
        tensor_bytes(optimizer_state_tensors(optimizer))
    return {"state": state, "comm": {}, "step_s": statistics.median(times), "losses": losses,
            "rss": peak_rss_bytes(), "params": sum(p.numel() for p in net.parameters())}


def run_case(case: Case, nproc: int, model: str, steps: int, warmup: int, timeout_s: float = 900.0) -> dict:
    """Spawn the case's world, run it, and fold the ranks into one row (worst rank for time, memory, comm)."""
    from paratrain.testing import World

    world = World(1 if case.threads else nproc, timeout_s=timeout_s)
    try:
        if case.threads:
            ranks = world.run(threads_case, case, model, steps, warmup, nproc)
        else:
            ranks = world.run(engine_case, case, model, steps, warmup)
    finally:
        world.stop()
    comm: dict[str, float] = {}
    for rank in ranks:
        for axis, ops in rank["comm"].items():
            comm[axis] = max(comm.get(axis, 0.0), sum(ops.values()))
    return {"case": case.name, "strategy": case.strategy, "layout": case.layout(nproc), "ranks": len(ranks),
            "state_per_rank": [r["state"] for r in ranks], "comm_per_step": comm,
            "comm_ops": ranks[0]["comm"], "step_s": max(r["step_s"] for r in ranks),
            "peak_rss": max(r["rss"] for r in ranks), "losses": ranks[0]["losses"], "params": ranks[0]["params"],
            "memory_formula": case.memory_formula, "comm_formula": case.comm_formula}
