"""How the engine is put together from initialize()'s arguments: optimizer, param groups, scheduler, loader."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import Config
from paratrain.data import DataParallelLoader, DataParallelSampler
from paratrain.data.stream_loader import StreamLoader
from paratrain.errors import InvalidValueError, RunError
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
    parallelism, expert parallelism and deferred initialization replace parameter objects, names survive).
    Every trainable parameter must be in exactly one group: refused here, on every rank, before any collective."""
    groups = param_groups(model_parameters)
    if groups is None:
        return None
    name_of = {id(p): n for n, p in model.named_parameters()}
    out, seen = [], set()
    for gi, group in enumerate(groups):
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        stray = [tuple(p.shape) for p in params if id(p) not in name_of]
        if stray:
            raise InvalidValueError(f"initialize(model_parameters=...): group {gi} holds {len(stray)} tensor(s) that "
                                    f"are not parameters of the model (shapes {stray[:3]}); pass groups of "
                                    f"model.parameters() only")
        names = [name_of[id(p)] for p in params]
        twice = [n for n in names if n in seen]
        if twice:
            raise InvalidValueError(f"initialize(model_parameters=...): parameter '{twice[0]}' is in two groups "
                                    f"(again in group {gi}); put each parameter in exactly one group")
        seen.update(names)
        out.append({**group, "params": names})
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in seen]
    if missing:
        raise InvalidValueError(f"initialize(model_parameters=...): {len(missing)} trainable parameter(s) in no "
                                f"group: {missing[:4]}; put every parameter with requires_grad in a group (or "
                                f"freeze it: requires_grad_(False))")
    return out


def local_param_groups(groups: list[dict] | None, parallel, named_params: list) -> list[dict] | None:
    """The named groups over the parameters the strategy holds here (`named_params`), each found by its name in
    the model initialize() was given (`ParallelModel.model_name`: tensor parallelism's slices, a packed
    layer's parts, expert parallelism's local stacks and a pipeline stage's layers all answer with the tensor
    they came from, so each keeps the options of its group)."""
    if groups is None:
        return None
    group_of = {name: gi for gi, g in enumerate(groups) for name in g["params"]}
    out = [{**g, "params": []} for g in groups]
    for name, param in named_params:
        model_name = parallel.model_name(name, param)
        if model_name not in group_of:  # every trainable parameter was checked to be in a group: a step lost it
            raise RunError(f"parameter '{name}' of the parallel model came from '{model_name}', which no param "
                           f"group holds; {parallel.explain(parallel.origin(name, param).name)}")
        out[group_of[model_name]]["params"].append(param)
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

