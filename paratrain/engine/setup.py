"""How the engine is put together from initialize()'s arguments: optimizer, param groups, scheduler, loader."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import Config
from paratrain.data import DataParallelLoader, DataParallelSampler
from paratrain.data.stream_loader import StreamLoader
from paratrain.errors import InvalidValueError
from paratrain.muon import Muon
from paratrain.optim import build_optimizer, build_scheduler


def optimizer_factory(config: Config, optimizer):
    """A callable params -> optimizer over what the strategy updates (a flat shard under ZeRO)."""
    if optimizer is None:
        if config.optimizer is None:
            raise InvalidValueError("no optimizer: pass optimizer= to initialize() or set the config's 'optimizer' "
                                    "section, e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-3}}")
        return lambda params: build_optimizer(config.optimizer, params)
    if isinstance(optimizer, (torch.optim.Muon, Muon)):  # re-created over 1-d ZeRO shards and tp slices, it
        # would orthogonalize shards (torch's) or take them for AdamW's (paratrain's, whose groups say nothing)
        raise InvalidValueError(f"initialize(optimizer={type(optimizer).__module__}.Muon(...)): a ready Muon would be "
                                "re-created over the tensors a strategy updates (ZeRO shards, tp slices), which are "
                                "not matrices; set the config's optimizer to {\"type\": \"Muon\", \"params\": "
                                "{...}} instead: paratrain makes its groups from the model and orthogonalizes whole "
                                "matrices in every layout")
    if isinstance(optimizer, torch.optim.Optimizer):
        # A ready optimizer is re-created over what the strategy updates (a shard under ZeRO).
        return lambda params: optimizer if _same_params(optimizer, params) else \
            type(optimizer)(params, **optimizer.defaults)
    return optimizer  # a callable params -> optimizer, as DeepSpeed accepts


def param_groups(model_parameters):
    """initialize(model_parameters=...) as param groups (dicts with options), or None for the default."""
    if model_parameters is None:
        return None
    groups = list(model_parameters)
    if groups and isinstance(groups[0], dict):
        return groups
    return None  # a flat list of the model's parameters is the default anyway


def named_param_groups(model: nn.Module, model_parameters) -> list[dict] | None:
    """The param groups with each parameter replaced by its name in `model` (before any strategy runs: tensor
    parallelism and deferred initialization replace parameter objects, names survive)."""
    groups = param_groups(model_parameters)
    if groups is None:
        return None
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = []
    for gi, group in enumerate(groups):
        stray = [tuple(p.shape) for p in group["params"] if id(p) not in name_of]
        if stray:
            raise InvalidValueError(f"initialize(model_parameters=...): group {gi} holds {len(stray)} tensor(s) that "
                                    f"are not parameters of the model (shapes {stray[:3]}); pass groups of "
                                    f"model.parameters() only")
        out.append({**group, "params": [name_of[id(p)] for p in group["params"]]})
    return out


def local_param_groups(groups: list[dict] | None, parallel, named_params: list) -> list[dict] | None:
    """The named groups over the parameters the strategy holds here (`named_params`), each found by the
    original tensor it is (a packed layer's parts all join their tensor's group); a parameter another
    pipeline stage keeps is left out."""
    if groups is None:
        return None
    group_of = {name: gi for gi, g in enumerate(groups) for name in g["params"]}
    out = [{**g, "params": []} for g in groups]
    for name, param in named_params:
        original = parallel.origin(name, param).name
        if original in group_of:
            out[group_of[original]]["params"].append(param)
    return out


def make_scheduler(config: Config, optimizer, lr_scheduler):
    """initialize(lr_scheduler=...) as given (or built from a callable over the optimizer), else the config's."""
    if lr_scheduler is not None:
        return lr_scheduler(optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") \
            else lr_scheduler
    if config.scheduler is not None:
        return build_scheduler(config.scheduler, optimizer)
    return None


def make_loader(engine, dataset, collate_fn) -> DataParallelLoader:
    """The dp-axis loader: every rank of a dp replica (pp, cp, tp peers) draws the same micro-batches."""
    if hasattr(dataset, "rows_from"):  # a RowStream (data.streaming): rows made while training
        return StreamLoader(dataset, engine.train_micro_batch_size_per_gpu(), engine.mesh.dims.sample_parallel_size,
                            engine.mesh.local_rank("dp"), engine.gradient_accumulation_steps(),
                            seed=engine.config.seed, shuffle=engine.config.data.shuffle, collate_fn=collate_fn)
    sampler = DataParallelSampler(len(dataset), engine.train_micro_batch_size_per_gpu(),
                                  engine.mesh.dims.sample_parallel_size, engine.mesh.local_rank("dp"),
                                  engine.gradient_accumulation_steps(), seed=engine.config.seed,
                                  shuffle=engine.config.data.shuffle)
    return DataParallelLoader(dataset, sampler, collate_fn)


def _same_params(optimizer: torch.optim.Optimizer, params) -> bool:
    flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else list(params)
    mine = [p for g in optimizer.param_groups for p in g["params"]]
    return len(flat) == len(mine) and all(a is b for a, b in zip(flat, mine))

