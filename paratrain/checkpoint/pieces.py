"""What each rank holds of the original model, as pieces; checked across ranks; assembled into full tensors.

A piece is a flat range [start, end) of a box of one original tensor (`Origin`: name, full shape, the box the
rank holds). The model's pieces are the data-parallel strategy's masters (`master_segments`: fp32 flat
ranges) and the module's other tensors (buffers, frozen parameters), each located by undoing the steps of
`parallelize` (`ParallelModel.origin`). Checkpoints write them (`save.py`), `full_state_dict` assembles them
(`gather_full_state`), and both first agree that they describe one consistent model (`check_pieces`):

- a piece's full shape agrees with its tensor's placement (a dimension split over an axis has the split's
  full size there) and with the same tensor's pieces on every other rank;
- pieces held on several ranks as copies (replicated over a model-parallel axis) are bit-identical there;
- the pieces one rank per copy keeps (`owns`) cover every element of every tensor exactly once.
A failure names the tensor and the step that recorded it, before anything is written or assembled.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.adapters.quantized import packed_matrix_shape
from paratrain.checkpoint.format import CheckpointError
from paratrain.checkpoint.reshard import Piece, coverage_problem, read_full
from paratrain.comm import all_gather_object, broadcast
from paratrain.layout.mesh import Mesh
from paratrain.layout.origin import Origin
from paratrain.layout.placement import Shard


@dataclass
class HeldPiece:
    key: str  # "model/<original name>"
    origin: Origin
    start: int
    end: int
    data: torch.Tensor  # the piece's `end - start` elements, flat (a view of the live tensor where possible)
    copies: tuple = ()  # the data-parallel axes whose ranks all hold this same piece (`GradSync.replicas`)
    master: torch.Tensor | None = None  # the optimizer's tensor these elements are part of (None: a buffer)
    offset: int = 0  # where they start in the flattened master (its optimizer states are cut alike)
    target: torch.Tensor | None = None  # the module's whole tensor, for a piece that is one (a buffer, say)
    frozen: bool = False  # of a frozen parameter (a LoRA base): no gradient, no optimizer state
    held_shape: tuple | None = None  # the shape the module's state dict holds it in, where the origin's differs

    def write(self, value: torch.Tensor) -> None:
        """Set the piece's elements to `value` (flat, `end - start` elements)."""
        if self.target is not None:
            self.target.detach().copy_(value.view(self.target.shape))
        else:
            self.data.copy_(value)


def _segment_pieces(parallel, tensor: torch.Tensor, segments, params: dict, optimized: bool) -> list[HeldPiece]:
    """The pieces of one strategy tensor (a master, or a frozen shard) that holds `segments` of parameters."""
    sync, flat = parallel.grad_sync, tensor.detach().view(-1)
    out = []
    for seg in segments:
        param = params[seg.name]
        origin = parallel.origin(seg.name, param)
        data = flat[seg.offset:seg.offset + seg.end - seg.start]
        copies = sync.replicas(param, sharded=not (optimized and sync.masters_replicated))
        out.append(HeldPiece(f"model/{origin.name}", origin, seg.start, seg.end, data, copies,
                             tensor if optimized else None, seg.offset, frozen=not optimized,
                             held_shape=_held_shape(param)))
    return out


def _held_shape(tensor: torch.Tensor) -> tuple | None:
    """A 4-bit weight's packed bytes are located as the matrix they encode (`packed_matrix_shape`), and held by
    bitsandbytes' state dict as one column: (rows·columns/2, 1), by torchao's NF4 as a vector. None for any other
    tensor."""
    if getattr(tensor, "nf4_held_shape", None) is not None:  # torchao's NF4 packed bytes: (n/2,)
        return tensor.nf4_held_shape
    matrix = packed_matrix_shape(tensor)
    return None if matrix is None else (matrix[0] * matrix[1], 1)


def model_pieces(parallel) -> list[HeldPiece]:
    """This rank's pieces of the model (the one walk that checkpoints, `full_state_dict`, weights and loading
    share): the fp32 masters of trainable parameters, the frozen shards a strategy keeps (ZeRO-3), every other
    tensor of the module as it is."""
    sync = parallel.grad_sync
    # the module's parameters, and the tensors a strategy shards besides them under their state-dict names (ZeRO-3:
    # a 4-bit weight's scales, parallel/dp/frozen.py)
    params = {**dict(parallel.module.named_parameters()), **dict(sync.named_frozen)}
    out = []
    for master, segments in sync.master_segments():
        out += _segment_pieces(parallel, master, segments, params, optimized=True)
    frozen = sync.frozen_segments()
    for shard, segments in frozen:
        out += _segment_pieces(parallel, shard, segments, params, optimized=False)
    covered = {id(p) for _, p in [*sync.named_params, *sync.named_frozen]}
    for name, t in parallel.module.state_dict(keep_vars=True).items():
        if id(t) in covered:
            continue  # a parameter (or a tied alias of one) held above
        origin = parallel.origin(name, t)
        data = t.detach().view(-1) if t.is_contiguous() else t.detach().reshape(-1)
        # replicated over the axes the strategy reduces it over: an expert's over the ranks holding its experts
        out.append(HeldPiece(f"model/{origin.name}", origin, 0, t.numel(), data, sync.replicas(t, sharded=False),
                             target=t, frozen=isinstance(t, nn.Parameter) and not t.requires_grad,
                             held_shape=_held_shape(t)))
    return out


def placement_problem(pieces: list[HeldPiece], parallel) -> str | None:
    """A box whose full shape contradicts its tensor's placement means a step located the tensor wrongly
    (it would be stored as a whole tensor while it is one rank's slice): the first such, naming the steps."""
    for piece in pieces:
        o = piece.origin
        for axis, kind in o.placement.axes:
            if isinstance(kind, Shard) and (o.shape[kind.dim] != kind.whole or axis in o.replicated):
                whole = f" held whole on every {axis} rank" if axis in o.replicated else ""
                return (f"'{o.name}' is split over {axis} along dim {kind.dim} (full size {kind.whole}), but undoing "
                        f"the steps {[s.name for s in parallel.steps]} locates it as a box of a tensor of shape "
                        f"{list(o.shape)}{whole}; {parallel.explain(o.name)}")
    return None


def owns(origin: Origin, copies: tuple, mesh: Mesh) -> bool:
    """Whether this rank keeps a piece held as copies by several ranks: the one whose index on each axis of
    copies (data-parallel, `copies`; model-parallel, the origin's) is crc32(name) mod the axis size (spreads
    replicated tensors over the ranks instead of rank 0)."""
    h = zlib.crc32(origin.name.encode())
    axes = [*copies, *(mesh.axis(a) for a in origin.replicated)]
    return all(axis.rank == h % axis.size for axis in axes)


def describe(piece: HeldPiece, owned: bool, rank: int) -> dict:
    o = piece.origin
    digest = None
    if o.replicated:  # copies over a model-parallel axis must be equal there: compare their digests
        digest = hashlib.sha1(piece.data.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
    return {"key": piece.key, "name": o.name, "shape": list(o.shape), "dtype": str(piece.data.dtype).split(".")[-1],
            "offsets": list(o.offsets), "box": list(o.local_shape), "start": piece.start, "end": piece.end,
            "rank": rank, "owned": owned, "digest": digest, "replicated": list(o.replicated),
            **({"held_shape": list(piece.held_shape)} if piece.held_shape else {})}


def check_pieces(everyone: list[dict], explain) -> str | None:
    """None if the pieces of every rank describe one consistent model; else the first problem found."""
    by_key: dict[str, list[dict]] = {}
    for d in everyone:
        by_key.setdefault(d["key"], []).append(d)
    for key, pieces in sorted(by_key.items()):
        name, first = pieces[0]["name"], pieces[0]
        for d in pieces[1:]:
            if d["shape"] != first["shape"] or d["dtype"] != first["dtype"]:
                return (f"'{name}' is a tensor of shape {first['shape']} ({first['dtype']}) on rank "
                        f"{first['rank']} but {d['shape']} ({d['dtype']}) on rank {d['rank']}: one rank holds a slice "
                        f"it records as a whole tensor; {explain(name)}")
        copies: dict[tuple, dict] = {}
        for d in pieces:
            if d["digest"] is None:
                continue
            where = (tuple(d["offsets"]), tuple(d["box"]), d["start"], d["end"])
            other = copies.setdefault(where, d)
            if other["digest"] != d["digest"]:
                axes = "/".join(d["replicated"])
                return (f"tensors replicated over {axes} differ between {axes} ranks: '{name}' is recorded as the "
                        f"same tensor on every {axes} rank, but rank {other['rank']} and rank {d['rank']} hold "
                        f"different values; {explain(name)}")
        owned = [Piece(str(d["rank"]), key, tuple(d["offsets"]), tuple(d["box"]), d["start"], d["end"])
                 for d in pieces if d["owned"]]
        problem = coverage_problem(name, tuple(first["shape"]), owned)
        if problem:
            return f"{problem}; {explain(name)}"
    return None


def tied_aliases(parallel) -> dict[str, str]:
    """{other original name of a tied parameter: the original name its master is stored under}."""
    primary = {id(p): n for n, p in parallel.grad_sync.named_params}
    out = {}
    for name, t in parallel.module.state_dict(keep_vars=True).items():
        if id(t) in primary and primary[id(t)] != name:
            out[parallel.origin(name, t).name] = parallel.origin(primary[id(t)], t).name
    return out


def agree_on_pieces(pieces: list[HeldPiece], parallel, mesh: Mesh) -> tuple[list[dict], dict[str, str]]:
    """Every rank's piece descriptions and tied aliases (collective over the world), checked on every rank;
    a problem found on any rank raises the same error on every rank (no rank is left waiting)."""
    mine = [describe(p, owns(p.origin, p.copies, mesh), mesh.rank) for p in pieces]
    local = placement_problem(pieces, parallel)
    gathered = all_gather_object((mine, tied_aliases(parallel), local), mesh.world, tag="checkpoint")
    everyone = [d for part, _, _ in gathered for d in part]
    aliases = {k: v for _, part, _ in gathered for k, v in part.items()}
    problem = next((p for _, _, p in gathered if p), None) or check_pieces(everyone, parallel.explain)
    if problem:
        raise CheckpointError(problem)
    return everyone, aliases


def gather_full_state(parallel, mesh: Mesh, device: torch.device) -> dict[str, torch.Tensor]:
    """The whole model under its original names, on every rank (collective over the world): each rank
    broadcasts the pieces it keeps, one message per rank and dtype, and every rank assembles them."""
    pieces = model_pieces(parallel)
    everyone, aliases = agree_on_pieces(pieces, parallel, mesh)
    world = mesh.world
    mine = [p for p, d in zip(pieces, (d for d in everyone if d["rank"] == mesh.rank)) if d["owned"]]
    received: dict[tuple[str, int, tuple, int], torch.Tensor] = {}
    for rank in range(world.size):
        theirs = [d for d in everyone if d["rank"] == rank and d["owned"]]
        for dtype in sorted({d["dtype"] for d in theirs}):
            group = [d for d in theirs if d["dtype"] == dtype]
            if rank == mesh.rank:
                flat = torch.cat([p.data.to(device).reshape(-1) for p in mine if _dtype_name(p.data) == dtype])
            else:
                flat = torch.empty(sum(d["end"] - d["start"] for d in group), dtype=getattr(torch, dtype),
                                   device=device)
            broadcast(flat, world, src=rank, tag="state_dict")
            offset = 0
            for d in group:
                size = d["end"] - d["start"]
                received[(d["key"], rank, tuple(d["offsets"]), d["start"])] = flat[offset:offset + size]
                offset += size
    full = _assemble(everyone, received, device)
    full.update({alias: full[name] for alias, name in aliases.items()})
    return full


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).split(".")[-1]


def _assemble(everyone: list[dict], received: dict, device: torch.device) -> dict[str, torch.Tensor]:
    by_key: dict[str, list[dict]] = {}
    for d in everyone:
        if d["owned"]:
            by_key.setdefault(d["key"], []).append(d)
    out = {}
    for key, owned in by_key.items():
        first = owned[0]
        pieces = [Piece(str(d["rank"]), key, tuple(d["offsets"]), tuple(d["box"]), d["start"], d["end"])
                  for d in owned]

        def fetch(piece: Piece, lo: int, hi: int, key=key):
            return received[(key, int(piece.file), piece.offsets, piece.start)][lo:hi].cpu()

        shape = tuple(first["shape"])
        full = read_full(pieces, fetch, shape, getattr(torch, first["dtype"])) if math.prod(shape) else \
            torch.empty(shape, dtype=getattr(torch, first["dtype"]))
        held = first.get("held_shape")  # a 4-bit weight: back in the shape its module's state dict has
        out[first["name"]] = (full.view(held) if held else full).to(device)
    return out
