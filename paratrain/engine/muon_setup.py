"""Muon in the engine: its param groups, made from the model before any strategy runs (every refusal before a
collective), and the binding that tells it what each of its tensors holds after the strategy built them."""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from paratrain.config import Config, ConfigError
from paratrain.errors import InvalidValueError
from paratrain.model_spec import spec_for
from paratrain.muon import Muon, muon_shape_problem
from paratrain.parallel.tp.plan import packed_parts


def muon_param_groups(model: nn.Module, config: Config, groups: list[dict] | None, optimizer=None) -> list | None:
    """With `optimizer.type: "Muon"` (and no ready optimizer), the named groups split into a Muon half
    (`use_muon: true`: the model spec's hidden matrices, `ModelSpec.muon_parameters`) and an AdamW half, as
    DeepSpeed splits its Muon groups; a parameter tagged `use_muon` (DeepSpeed's attribute) or named by
    `optimizer.params.muon_names` / `adamw_names` goes where it says. Groups that already say `use_muon` are kept.
    Other optimizers: `groups` as given."""
    if optimizer is not None or config.optimizer is None or config.optimizer.type.lower() != "muon":
        return groups
    spec, params = spec_for(model), dict(model.named_parameters())
    chosen = set(spec.muon_parameters(model))
    for name, p in params.items():
        tag = getattr(p, "use_muon", None)
        for key, value in (("adamw_names", False), ("muon_names", True)):
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in config.optimizer.params.get(key, ())):
                tag = value
        if tag is not None:
            (chosen.add if tag else chosen.discard)(name)
    _check_patterns(config, list(params))
    out = []
    for group in groups or [{"params": [n for n, p in params.items() if p.requires_grad]}]:
        if "use_muon" in group:
            out.append(group)
            continue
        options = {k: v for k, v in group.items() if k != "params"}
        for use_muon in (True, False):
            half = [n for n in group["params"] if (n in chosen) is use_muon]
            if half:
                out.append({**options, "params": half, "use_muon": use_muon})
    _check_matrices(model, config, [n for g in out if g["use_muon"] for n in g["params"]])
    return out


def _check_patterns(config: Config, names: list[str]) -> None:
    for key in ("adamw_names", "muon_names"):
        for i, pattern in enumerate(config.optimizer.params.get(key, ())):
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ConfigError(f"optimizer.params.{key}[{i}] = {pattern!r} matches no parameter of the model; "
                                  f"names look like {names[:3]} (fnmatch patterns: '*.router.weight')")


def _check_matrices(model: nn.Module, config: Config, muon: list[str]) -> None:
    """Every Muon parameter a matrix (or an expert stack), and none a part of a packed projection split over tp."""
    params, spec = dict(model.named_parameters()), spec_for(model)
    stacks = {id(getattr(owner, attr)) for _, layer in spec.expert_layers(model) for owner, attr in layer.stacked}
    for name in muon:
        problem = muon_shape_problem(tuple(params[name].shape), id(params[name]) in stacks)
        if problem:
            raise InvalidValueError(f"optimizer Muon: parameter '{name}' has {problem}; leave it to the AdamW part "
                                    f"(optimizer.params.adamw_names, or use_muon: false in its group)")
    if config.tensor_parallel.size > 1:
        packed = {f"{path}.weight" for path in packed_parts(model, config.tensor_parallel.plan)}
        split = sorted(packed & set(muon))
        if split:
            raise InvalidValueError(f"optimizer Muon with tensor_parallel.size > 1: '{split[0]}' is a packed "
                                    f"projection (q, k, v in one weight) that tp splits into parts; torch's Muon "
                                    f"orthogonalizes "
                                    f"it as one matrix, which paratrain does not assemble yet: add it to "
                                    f"optimizer.params.adamw_names, or use tensor_parallel.size 1")


def bind_muon(optimizer, grad_sync, mesh, device: torch.device) -> None:
    """Give a Muon optimizer what each of its tensors holds (whole parameters, tp slices, ZeRO shards), so it
    orthogonalizes whole matrices (`paratrain.muon.layout`)."""
    if isinstance(optimizer, Muon):
        pairs = grad_sync.muon_layouts()
        optimizer.bind([m for m, _ in pairs], [layout for _, layout in pairs], mesh.axis("tp"), device)
