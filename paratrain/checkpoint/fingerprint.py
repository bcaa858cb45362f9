"""A fingerprint of the frozen base, the same in every layout: what a checkpoint without it (DeepSpeed's
`exclude_frozen_parameters`) records, so that resuming it on another base is refused by name.

    prints = frozen_fingerprint(parallel, mesh)      # {name: [Σ c_i·w_i, Σ w_i²]} (collective)

Each element w_i of a frozen tensor is counted once, by the rank that owns its piece (the pieces a checkpoint
writes: every element owned by exactly one rank), with a weight c_i in [0, 1) that is a fixed function of its
index in the whole tensor (Knuth's multiplicative hash), so swapped rows or a reshaped tensor change the sum; one
all-reduce in float64 adds the ranks' parts. Sums in another layout add the same terms in another order, so two
fingerprints of one base agree to ~1e-15 relative and are compared at `TOLERANCE`; another base (a new seed,
another checkpoint, another dtype) differs in the first digits.
"""

from __future__ import annotations

import torch

from paratrain.checkpoint.pieces import agree_on_pieces, model_pieces
from paratrain.comm import all_reduce

TOLERANCE = 1e-9
CHUNK = 1 << 20  # elements whose indices are computed at once (8 bytes each)


def _piece_sums(piece) -> tuple[float, float]:
    """(Σ c_i·w_i, Σ w_i²) over one piece, c_i from each element's flat index in the whole tensor."""
    shape, box, offsets = piece.origin.shape, piece.origin.local_shape, piece.origin.offsets
    data = piece.data.detach().to(torch.float64).reshape(-1)
    weighted, squares = 0.0, float(data.pow(2).sum())
    for lo in range(0, data.numel(), CHUNK):
        local = torch.arange(piece.start + lo, piece.start + min(lo + CHUNK, data.numel()))
        flat = _global_index(local, box, offsets, shape)
        c = ((flat * 2654435761) % 2**32).to(torch.float64) / 2**32
        weighted += float((c * data[lo:lo + local.numel()]).sum())
    return weighted, squares


def _global_index(local: torch.Tensor, box, offsets, shape) -> torch.Tensor:
    """Flat indices in the whole tensor of flat indices `local` into the box at `offsets`."""
    flat = torch.zeros_like(local)
    stride_box, stride_whole = 1, 1
    for d in reversed(range(len(box))):
        coord = (local // stride_box) % box[d] + offsets[d]
        flat += coord * stride_whole
        stride_box *= box[d]
        stride_whole *= shape[d]
    return flat


def frozen_fingerprint(parallel, mesh) -> dict[str, list[float]]:
    """{original name of every frozen parameter: its two sums} (collective over the world)."""
    pieces = [p for p in model_pieces(parallel) if p.frozen]
    everyone, _ = agree_on_pieces(pieces, parallel, mesh)
    names = sorted({d["name"] for d in everyone})
    index = {name: i for i, name in enumerate(names)}
    sums = torch.zeros(len(names), 2, dtype=torch.float64)
    mine = [d["owned"] for d in everyone if d["rank"] == mesh.rank]
    for piece, owned in zip(pieces, mine):
        if owned:
            sums[index[piece.origin.name]] += torch.tensor(_piece_sums(piece), dtype=torch.float64)
    if names:
        all_reduce(sums, mesh.world, tag="checkpoint")
    return {name: sums[i].tolist() for name, i in index.items()}


def fingerprint_problem(saved: dict[str, list[float]], mine: dict[str, list[float]]) -> str | None:
    """Why the model's frozen base is not the one the checkpoint was saved with (None: it is)."""
    for name, want in sorted(saved.items()):
        got = mine.get(name)
        if got is None:
            return f"the model has no frozen tensor '{name}'"
        if any(abs(g - w) > TOLERANCE * max(abs(w), 1e-30) for g, w in zip(got, want)):
            return f"its frozen tensor '{name}' is not the one the checkpoint was saved with"
    return None
