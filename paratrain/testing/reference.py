"""The single-process reference every layout is compared against: one model, the whole global batch.

It uses plain PyTorch only (no engine, no process group), the same optimizer/scheduler construction as
the engine, and torch's own `clip_grad_norm_`, so a parity failure points at the parallel code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.adapters.torchao_nf4 import is_nf4_weight
from paratrain.config import Config, load_config
from paratrain.data import DataParallelLoader, DataParallelSampler
from paratrain.engine.muon_setup import muon_param_groups
from paratrain.muon import Muon
from paratrain.muon.optimizer import ADAMW_DEFAULTS, MUON_DEFAULTS
from paratrain.optim import build_optimizer, build_scheduler, muon_options
from paratrain.precision import autocast_context, compute_dtype, make_loss_scaler


@dataclass
class RunRecord:
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, torch.Tensor]
    states: list[dict[str, torch.Tensor]] | None = None  # after every step (keep_states=True)


def global_batches(dataset, config: Config, seed: int | None = None, collate_fn=None) -> DataParallelLoader:
    """An iterator of whole global batches, in the order the data-parallel sampler hands them out."""
    sampler = DataParallelSampler(len(dataset), config.train_batch_size, 1, 0, 1,
                                  seed=config.seed if seed is None else seed)
    return DataParallelLoader(dataset, sampler, collate_fn)


def reference_run(make_model: Callable[[], nn.Module], config: Config | dict, dataset, steps: int,
                  loss_of: Callable[[nn.Module, object], torch.Tensor] | None = None,
                  param_groups: Callable[[nn.Module], list[dict]] | None = None,
                  keep_states: bool = False, collate_fn=None) -> RunRecord:
    """Train `steps` optimizer steps on one process. `config` must have train_batch_size resolved.

    Under bf16/fp16 the model computes in the low dtype and an fp32 master copy of every parameter (taken
    before the cast) is what the optimizer updates, with fp16's loss scaling and skipped steps: the
    textbook mixed-precision loop, which the distributed strategies must match within that dtype's
    rounding. The returned state holds the fp32 masters. `param_groups(model)` gives optimizer param
    groups (dicts of the model's parameters with options), as passed to initialize(model_parameters=...).
    `keep_states` also records the state after every step. `collate_fn` collates each global batch (as the
    engine's loader collates each micro-batch).
    """
    cfg = load_config(config)
    model = make_model()
    masters, optimizer = _masters_and_optimizer(model, cfg, param_groups)
    scaler = make_loss_scaler(cfg.fp16)
    scheduler = build_scheduler(cfg.scheduler, optimizer) if cfg.scheduler is not None else None
    batches = global_batches(dataset, cfg, collate_fn=collate_fn)
    loss_of = loss_of or (lambda m, batch: m(*batch))
    autocast = autocast_context(cfg.torch_autocast.enabled, torch.device("cpu"))  # torch_autocast: fp32 model
    losses, norms, states = [], [], []

    def current_state() -> dict[str, torch.Tensor]:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state.update({k: v.detach().clone() for k, v in masters.items() if k in state and not is_nf4_weight(v)})
        return state

    for _ in range(steps):
        with autocast():
            loss = loss_of(model, next(batches))
        (loss * (scaler.scale if scaler else 1.0)).backward()
        losses.append(float(loss.detach()))
        if cfg.precision != "fp32":
            for name, p in model.named_parameters():
                masters[name].grad = p.grad.float() / (scaler.scale if scaler else 1.0)
                p.grad = None
        max_norm = cfg.gradient_clipping if cfg.gradient_clipping > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(list(masters.values()), max_norm))
        norms.append(norm)
        if scaler is not None:
            overflow = not math.isfinite(norm)
            scaler.update(overflow)
            if overflow:
                optimizer.zero_grad(set_to_none=True)
                if keep_states:
                    states.append(current_state())
                continue
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if cfg.precision != "fp32":
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(masters[name])
        if keep_states:
            states.append(current_state())
    return RunRecord(losses, norms, current_state(), states if keep_states else None)


def _masters_and_optimizer(model: nn.Module, cfg: Config, param_groups) -> tuple[dict[str, nn.Parameter], object]:
    """The parameters the optimizer updates (the model's own in fp32, a frozen torchao NF4 weight among them, whose
    state-dict entries are its plain tensors, never the master; fp32 copies taken before the model is cast
    to the low dtype otherwise) and the optimizer over them, in `param_groups(model)` if given."""
    masters = {name: p for name, p in model.named_parameters()}
    if cfg.precision != "fp32":
        masters = {name: nn.Parameter(p.detach().float().clone()) for name, p in model.named_parameters()}
        model.to(compute_dtype(cfg.precision))
    if cfg.optimizer.type.lower() == "muon":
        return masters, TorchMuonWithAdamW(model, masters, cfg, param_groups)
    if param_groups is None:
        return masters, build_optimizer(cfg.optimizer, list(masters.values()))
    master_of = {id(p): masters[name] for name, p in model.named_parameters()}
    return masters, build_optimizer(cfg.optimizer, [{**g, "params": [master_of[id(p)] for p in g["params"]]}
                                                    for g in param_groups(model)])


class TorchMuonWithAdamW(torch.optim.Optimizer):
    """The Muon reference: `torch.optim.Muon` on the model spec's hidden matrices, `torch.optim.AdamW` on the rest
    (the groups `paratrain.engine.muon_setup.muon_param_groups` makes, from `param_groups` when given). torch's
    Muon takes 2-d parameters and iterates in bfloat16 only: a stacked (E, rows, columns) expert weight, and every
    matrix under `ns_dtype: "float32"`, is stepped by paratrain's unbound `Muon`, which `tests/unit/test_muon.py`
    holds bit-equal to torch's Muon (run on each expert's matrix as its own parameter) and which differs from it
    under float32 only by the iteration's dtype."""

    def __init__(self, model: nn.Module, masters: dict[str, nn.Parameter], cfg: Config, param_groups=None):
        name_of = {id(p): n for n, p in model.named_parameters()}
        named = [{**g, "params": [name_of[id(p)] for p in g["params"]]} for g in param_groups(model)] \
            if param_groups is not None else None
        options, adamw = muon_options(cfg.optimizer.params)
        by_torch, by_us, rest = [], [], []
        for group in muon_param_groups(model, cfg, named):
            tensors = [masters[n] for n in group["params"]]
            if not group["use_muon"]:
                rest.append({**ADAMW_DEFAULTS, **adamw, **{k: v for k, v in group.items() if k in ADAMW_DEFAULTS},
                             "params": tensors})
                continue
            mine = {**options, **{k: v for k, v in group.items() if k in MUON_DEFAULTS}}
            # torch's own Muon where it can: 2-d matrices with its bfloat16 iteration
            torch_can = mine.get("ns_dtype", "bfloat16") == "bfloat16"
            theirs = {k: v for k, v in mine.items() if k != "ns_dtype"}
            by_torch.append({**theirs, "params": [t for t in tensors if torch_can and t.dim() == 2]})
            by_us.append({**mine, "use_muon": True, "params": [t for t in tensors if not (torch_can and t.dim() == 2)]})
        parts = [(torch.optim.Muon, [g for g in by_torch if g["params"]]), (Muon, [g for g in by_us if g["params"]]),
                 (torch.optim.AdamW, [{**g, "betas": tuple(g["betas"])} for g in rest])]
        self.parts = [cls(groups) for cls, groups in parts if groups]
        super().__init__([p for part in self.parts for g in part.param_groups for p in g["params"]], {})
        self.param_groups = [g for part in self.parts for g in part.param_groups]  # a scheduler reaches them all

    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)
