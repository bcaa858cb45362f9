"""The small, non-sharded state a checkpoint carries besides the model's pieces, as JSON (never pickle).

The stateful objects' `state_dict()`s (train state, random state, LR scheduler, loss scaler) and the user's
`client_state` are JSON with their tensors stored beside it in the safetensors files (`encode_state`); the
optimizer's per-group options and per-parameter scalars (Adam's `step`) are JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from paratrain.checkpoint.format import DTYPE_BY_NAME, DTYPE_NAMES, CheckpointError

TENSOR_REF = "__tensor__"  # {"__tensor__": key}: a tensor stored in a safetensors file under `key`


def json_value(value: Any, what: str) -> Any:
    """`value` as JSON (tuples become lists), or a CheckpointError naming `what`."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} cannot be stored in a checkpoint ({exc}); checkpoints hold JSON values and "
                              f"tensors only, never pickled objects") from None


# ---- JSON with tensors stored beside it ------------------------------------------------------------------
def _is_tensor_ref(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {TENSOR_REF}


def encode_state(value: Any, tensors: dict[str, torch.Tensor], prefix: str, what: str) -> Any:
    """`value` as JSON, each tensor in it replaced by {"__tensor__": key} and put into `tensors` under a key
    starting with `prefix`; anything else that is not a JSON value is refused, naming where it is."""
    return json_value(_encode(value, tensors, prefix, what), what)


_SCALARS = (bool, int, float, str, type(None))


def _encode(value: Any, tensors: dict[str, torch.Tensor], prefix: str, where: str) -> Any:
    """One walk (a state's long lists of numbers, Python's random state say, are its common case: one check)."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        key = f"{prefix}/{len(tensors)}"
        tensors[key] = value.detach()
        return {TENSOR_REF: key}
    if isinstance(value, Mapping):
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is not None:
            raise CheckpointError(f"{where}[{bad!r}] sits under a non-string key; checkpoints store dicts with "
                                  f"string keys")
        return {k: _encode(v, tensors, prefix, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, _SCALARS) for v in value):
            return list(value)
        return [_encode(v, tensors, prefix, f"{where}[{i}]") for i, v in enumerate(value)]
    raise CheckpointError(f"{where} is a {type(value).__name__}, which cannot be stored in a checkpoint; use JSON "
                          f"values (dict, list, str, int, float, bool, None) and tensors")


def decode_state(value: Any, read_tensor) -> Any:
    """The inverse of `encode_state`: `read_tensor(key)` gives each stored tensor back."""
    return tree_map(lambda v: read_tensor(v[TENSOR_REF]) if _is_tensor_ref(v) else v, value, is_leaf=_is_tensor_ref)


def tensor_keys(value: Any) -> list[str]:
    """The keys of the stored tensors an encoded value refers to."""
    return [v[TENSOR_REF] for v in tree_leaves(value, is_leaf=_is_tensor_ref) if _is_tensor_ref(v)]


# ---- optimizer: group options and per-parameter scalars --------------------------------------------------
def group_options(group: dict) -> dict:
    """The numeric options of a param group (lr, betas, weight_decay, ...): what schedules change and a
    resumed run must continue from. Flags (fused, foreach, ...) stay as the new engine built them."""
    out = {}
    for k, v in group.items():
        if k == "params" or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)) or (isinstance(v, (tuple, list)) and v and
                                           all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
            out[k] = list(v) if isinstance(v, (tuple, list)) else v
    return out


def restore_group_options(group: dict, saved: dict) -> None:
    for k, v in saved.items():
        if k in group and not isinstance(group[k], bool):
            group[k] = tuple(v) if isinstance(group[k], tuple) else v


def scalar_entry(value: Any, what: str) -> list:
    """[value, dtype] of an optimizer scalar state (a 0-d tensor or a number)."""
    if isinstance(value, torch.Tensor):
        return [value.item(), DTYPE_NAMES[value.dtype]]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value, "python"]
    raise CheckpointError(f"optimizer state {what} is a {type(value).__name__}; checkpoints store tensor and "
                          f"number optimizer states only")


def scalar_value(entry: list, master: torch.Tensor, group: dict):
    value, dtype = entry
    if dtype == "python":
        return value
    # torch keeps `step` on the parameter's device when the update is fused/capturable, on the CPU otherwise.
    device = master.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
    return torch.tensor(value, dtype=DTYPE_BY_NAME[dtype], device=device)

