"""`deepspeed.moe.utils` for `import paratrain as deepspeed`: telling expert parameters apart and DeepSpeed's
optimizer param groups for them.

`deepspeed.moe.layer.MoE` marks each expert parameter as DeepSpeed does: `allreduce = False` (not reduced over
all of data parallelism) and `group_name = "ep_size_<k>"` (its expert group). DeepSpeed's ZeRO needs the expert
parameters in param groups of their own, marked `moe: True`; paratrain's strategies find expert parameters by
their ep placement and do not need the split, but accept the groups, so a DeepSpeed script runs unchanged.

Written from DeepSpeed 0.19.8's documented behaviour, with two deliberate differences: a group without a 'name'
is accepted (DeepSpeed raises KeyError), and each input group gets its own expert groups even when two input
groups share a name (DeepSpeed merges them, keeping the last one's options); no empty chunk is made for a
parameter larger than `max_group_size`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.errors import InvalidTypeError

# DeepSpeed's default chunk: about 2^32 / 24 elements, so one group's flat buffers stay addressable
DEFAULT_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter of a `deepspeed.moe.layer.MoE` (marked `allreduce = False`)."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """(whether `model` has a deepspeed.moe.layer.MoE, the number of experts of the first one)."""
    from paratrain.moe.layer import MoE

    first = next((m for m in model.modules() if isinstance(m, MoE)), None)
    return (first is not None, first.num_experts if first is not None else 0)


def _as_group_list(param_groups) -> list[dict[str, Any]]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)):
        return list(param_groups)
    raise InvalidTypeError(f"split_params_into_different_moe_groups_for_optimizer(param_groups=...): got "
                           f"{type(param_groups).__name__}; pass a param group dict, or a list or tuple of them")


def _chunks(params: list[torch.Tensor], max_group_size: int | float | None) -> list[list[torch.Tensor]]:
    """Consecutive runs of `params` of at most `max_group_size` elements (a larger parameter alone)."""
    if max_group_size is None:
        return [params]
    runs: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        if runs and size + p.numel() <= max_group_size:
            runs[-1].append(p)
            size += p.numel()
        else:
            runs.append([p])
            size = p.numel()
    return runs


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size: int | float | None =
                                                         DEFAULT_MAX_GROUP_SIZE) -> list[dict[str, Any]]:
    """DeepSpeed's param groups for an MoE model: every input group with its expert parameters taken out (it
    may become empty), then, per input group and expert group name, that group's options with
    `name` = the expert group name (`ep_size_<k>`), `moe` = True and its expert parameters, cut into chunks of
    at most `max_group_size` elements (None: one chunk). The input groups are updated in place (as
    DeepSpeed's are), and a list passed in is extended and returned."""
    groups = param_groups if isinstance(param_groups, list) else _as_group_list(param_groups)
    expert_groups: list[dict[str, Any]] = []
    for group in list(groups):
        by_name: dict[str, list[torch.Tensor]] = {}
        dense = []
        for p in group["params"]:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
            else:
                dense.append(p)
        group["params"] = dense
        for name in sorted(by_name):  # sorted: every rank builds its optimizer's groups in the same order
            expert_groups += [{**group, "name": name, "moe": True, "params": chunk}
                              for chunk in _chunks(by_name[name], max_group_size)]
    groups.extend(expert_groups)
    return groups


def is_moe_param_group(param_group: dict) -> bool:
    """True for a group made by `split_params_into_different_moe_groups_for_optimizer` for experts."""
    return bool(param_group.get("moe", False))
