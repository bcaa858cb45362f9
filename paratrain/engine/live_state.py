"""A rank's whole training state in memory, for a peer in the same layout (healing a restarted replica group from a
live one, docs/fault-tolerance.md): its model pieces (the fp32 masters, buffers, frozen shards), its optimizer
state, the job's counters, scheduler and loss scaler, its random generators, and the loss window's unit. Only
between identical layouts (rank r of one group to rank r of another): a checkpoint is the any-layout form."""

from __future__ import annotations

import torch

from paratrain.checkpoint.pieces import model_pieces
from paratrain.checkpoint.target import CheckpointTarget
from paratrain.errors import RunError


def live_state(target: CheckpointTarget, unit: float | None) -> dict:
    """References, not copies: read while this rank does not train (torchft sends it inside its quorum call)."""
    return {"pieces": {p.key + f"@{p.start}": p.data for p in model_pieces(target.model)},
            "optimizer": target.optimizer.state_dict(),
            "states": {name: obj.state_dict() for name, obj in target.states.items()},
            "rank_states": {name: obj.state_dict() for name, obj in target.rank_states.items()},
            "unit": unit}


def load_live_state(target: CheckpointTarget, state: dict) -> float | None:
    """Put a peer's `live_state` into this rank's objects; returns the loss window's unit."""
    pieces = {p.key + f"@{p.start}": p for p in model_pieces(target.model)}
    if set(pieces) != set(state["pieces"]):
        missing = sorted(set(pieces) ^ set(state["pieces"]))[:3]
        raise RunError(f"a peer's live state does not hold this rank's pieces (e.g. {missing}): healing needs the "
                       f"same layout and model in every replica group")
    with torch.no_grad():
        for key, piece in pieces.items():
            piece.write(state["pieces"][key].to(piece.data.device, piece.data.dtype).reshape(-1))
    target.model.grad_sync.masters_loaded()
    target.optimizer.load_state_dict(state["optimizer"])
    for group in (target.states, target.rank_states):
        for name, obj in group.items():
            saved = state["states" if group is target.states else "rank_states"].get(name)
            if saved is not None:
                obj.load_state_dict(saved)
    return state["unit"]
