"""The single-process reference every layout is compared against: one model, the whole global batch.

It uses plain PyTorch only (no engine, no process group), the same optimizer/scheduler construction as
the engine, and torch's own `clip_grad_norm_`, so a parity failure points at the parallel code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.config import Config, load_config
from paratrain.data import DataParallelLoader, DataParallelSampler
from paratrain.optim import build_optimizer, build_scheduler


@dataclass
class RunRecord:
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, torch.Tensor]


def global_batches(dataset, config: Config, seed: int | None = None) -> DataParallelLoader:
    """An iterator of whole global batches, in the order the data-parallel sampler hands them out."""
    sampler = DataParallelSampler(len(dataset), config.train_batch_size, 1, 0, 1,
                                  seed=config.seed if seed is None else seed)
    return DataParallelLoader(dataset, sampler)


def reference_run(make_model: Callable[[], nn.Module], config: Config | dict, dataset, steps: int,
                  loss_of: Callable[[nn.Module, object], torch.Tensor] | None = None) -> RunRecord:
    """Train `steps` optimizer steps on one process. `config` must have train_batch_size resolved."""
    cfg = load_config(config)
    model = make_model()
    optimizer = build_optimizer(cfg.optimizer, model.parameters())
    scheduler = build_scheduler(cfg.scheduler, optimizer) if cfg.scheduler is not None else None
    batches = global_batches(dataset, cfg)
    loss_of = loss_of or (lambda m, batch: m(*batch))
    losses, norms = [], []
    for _ in range(steps):
        loss = loss_of(model, next(batches))
        loss.backward()
        max_norm = cfg.gradient_clipping if cfg.gradient_clipping > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return RunRecord(losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()})
