"""The small, non-sharded state a checkpoint carries besides tensors, as JSON (never pickle).

Engine counters, the LR scheduler's and loss scaler's `state_dict()`, the data position, the optimizer's
per-group options and per-parameter scalars (Adam's `step`), every rank's random-generator states
(torch CPU/CUDA and the per-rank streams of `parallelize` as tensors; Python's `random` as JSON), and the
user's `client_state` (JSON values and tensors).
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import torch

from paratrain.checkpoint.format import DTYPE_BY_NAME, DTYPE_NAMES, CheckpointError

log = logging.getLogger("paratrain")

COUNTERS = ("global_steps", "micro_steps", "global_samples", "skipped_steps")


def json_value(value: Any, what: str) -> Any:
    """`value` as JSON (tuples become lists), or a CheckpointError naming `what`."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} cannot be stored in a checkpoint ({exc}); checkpoints hold JSON values and "
                              f"tensors only, never pickled objects") from None


# ---- client state: JSON with tensors stored beside it -----------------------------------------------------
def encode_client(value: Any, tensors: dict[str, torch.Tensor], path: str = "client_state") -> Any:
    if isinstance(value, torch.Tensor):
        key = f"client/{len(tensors)}"
        tensors[key] = value.detach()
        return {"__tensor__": key}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise CheckpointError(f"{path} has non-string keys; checkpoints store dicts with string keys")
        return {k: encode_client(v, tensors, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_client(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"{path} is a {type(value).__name__}, which cannot be stored in a checkpoint; use JSON "
                          f"values (dict, list, str, int, float, bool, None) and tensors")


def decode_client(value: Any, read_tensor) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return read_tensor(value["__tensor__"])
        return {k: decode_client(v, read_tensor) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_client(v, read_tensor) for v in value]
    return value


# ---- random generators -------------------------------------------------------------------------------------
def rng_tensors(streams: dict) -> dict[str, torch.Tensor]:
    out = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["rng/torch_cuda"] = torch.cuda.get_rng_state()
    for name, stream in streams.items():
        for kind, state in stream.get_state().items():
            out[f"rng/{name}_{kind}"] = state
    return out


def python_rng() -> list:
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def restore_rng(tensors: dict[str, torch.Tensor], python_state: list | None, streams: dict,
                with_streams: bool) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    if "rng/torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/torch_cuda"])
    if python_state is not None:
        random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    if with_streams:
        for name, stream in streams.items():
            prefix = f"rng/{name}_"
            state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if state:
                stream.set_state(state)


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


# ---- data position -----------------------------------------------------------------------------------------
def data_state(engine) -> dict | None:
    loader = getattr(engine, "training_dataloader", None)
    if loader is None:
        return None
    s = loader.sampler
    return {"epoch": s.epoch, "samples_in_epoch": (s.position // s.accumulation) * s.global_batch, "seed": s.seed}


def restore_data(engine, state: dict | None) -> None:
    loader = getattr(engine, "training_dataloader", None)
    if loader is None or state is None:
        return
    s = loader.sampler
    done, rest = divmod(state["samples_in_epoch"], s.global_batch)
    if rest:
        log.warning("the checkpoint's data position (%d samples into epoch %d) is not a whole number of this "
                    "run's global batches (%d); resuming at the batch before it", state["samples_in_epoch"],
                    state["epoch"], s.global_batch)
    s.load_state_dict({"epoch": state["epoch"], "position": done * s.accumulation, "seed": state["seed"]})


def restore_counters(engine, saved: dict, saved_accumulation: int) -> None:
    for name in COUNTERS:
        setattr(engine, name, int(saved[name]))
    # micro_steps counts micro-batches: under another accumulation the same optimizer step is another count
    engine.micro_steps = engine.micro_steps // saved_accumulation * engine.gradient_accumulation_steps()

