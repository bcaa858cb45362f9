"""Loading under any layout: check everything first, agree, then read only what this rank needs.

[Note: no rank touches state until every rank has checked]
Phase 1 (no state changes): every rank reads the manifest (its own checksum), works out the region of each
original tensor it needs (`ParallelModel.origin` + `GradSync.master_segments`), checks names, shapes and the
optimizer type, checks that every rank's file exists with its recorded size, and verifies the sha256 of the
files it will read. Then one all-gather of the problems found: if any rank found one, every rank raises
the lowest rank's message, so the error is identical everywhere and no rank is left waiting in a collective.
Phase 2 reads the pieces, fills masters, optimizer states and buffers, and lets the strategy rebuild the
model's parameters from the masters (`GradSync.masters_loaded`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

import paratrain.comm as comm
from paratrain.checkpoint.fingerprint import fingerprint_problem, frozen_fingerprint
from paratrain.checkpoint.format import (
    DTYPE_BY_NAME,
    CheckpointError,
    read_latest,
    read_manifest,
    tag_dir,
    verify_file,
)
from paratrain.checkpoint.pieces import HeldPiece, model_pieces
from paratrain.checkpoint.reshard import Piece, coverage_problem, pieces_needed, read_region
from paratrain.checkpoint.state import decode_state, restore_group_options, scalar_value
from paratrain.checkpoint.target import CheckpointTarget
from paratrain.layout.origin import Origin

log = logging.getLogger("paratrain")


class PieceFiles:
    """The safetensors files of one tag, opened lazily (memory-mapped, no unpickling)."""

    def __init__(self, path: Path):
        self.path = path
        self._open: dict[str, object] = {}

    def _handle(self, file: str):
        if file not in self._open:
            self._open[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
        return self._open[file]

    def tensor(self, file: str, key: str) -> torch.Tensor:
        return self._handle(file).get_tensor(key)

    def fetch(self, piece: Piece, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of a piece (a whole box is stored with its shape, a flat range 1-d)."""
        if piece.start == 0 and piece.end == math.prod(piece.box) and len(piece.box) != 1:
            return self.tensor(piece.file, piece.key).reshape(-1)[lo:hi]
        return self._handle(piece.file).get_slice(piece.key)[lo:hi]


@dataclass
class _Plan:
    path: Path
    manifest: dict
    pieces: dict[str, list[Piece]]
    masters: list[tuple[torch.Tensor, list[HeldPiece]]] = field(default_factory=list)  # (master, its pieces)
    buffers: list[HeldPiece] = field(default_factory=list)  # pieces without optimizer state (buffers, frozen)
    names: set[str] = field(default_factory=set)  # the original tensors this rank holds
    files: set[str] = field(default_factory=set)  # the files this rank reads
    same_layout: bool = False

    def read(self, files: PieceFiles, key: str, origin: Origin, start: int, end: int, dtype) -> torch.Tensor:
        return read_region(self.pieces[key], files.fetch, origin.shape, origin.offsets, origin.local_shape, start,
                           end, dtype)


def _plan(target: CheckpointTarget, path: Path, optimizer_states: bool) -> _Plan:
    manifest = read_manifest(path)
    tensors = manifest["tensors"]
    plan = _Plan(path, manifest, {k: [Piece.from_json(p) for p in v] for k, v in manifest["pieces"].items()})
    for key, pieces in plan.pieces.items():
        problem = coverage_problem(key, tuple(tensors[key]["shape"]), pieces)
        if problem:
            raise CheckpointError(f"checkpoint '{path}': {problem}; load another tag")
    parallel = target.model
    gs = parallel.grad_sync

    def need(key: str, origin: Origin, start: int, end: int) -> bool:
        if key not in tensors:
            return False
        shape = tuple(tensors[key]["shape"])
        if shape != origin.shape:
            raise CheckpointError(f"'{origin.name}' has shape {list(shape)} in checkpoint '{path}' but "
                                  f"{list(origin.shape)} in this model: the checkpoint is of a different model; "
                                  f"load a checkpoint of this model, or build the model with the checkpoint's sizes")
        plan.files.update(p.file for p in pieces_needed(plan.pieces[key], shape, origin.offsets,
                                                        origin.local_shape, start, end))
        return True

    held: dict[int, list[HeldPiece]] = {id(master): [] for master, _ in gs.master_segments()}
    for piece in model_pieces(parallel):
        plan.names.add(piece.origin.name)
        if need(piece.key, piece.origin, piece.start, piece.end):
            (held[id(piece.master)] if piece.master is not None else plan.buffers).append(piece)
    plan.masters = [(master, held[id(master)]) for master, _ in gs.master_segments()]
    if optimizer_states and manifest["optimizer"] is not None:
        saved, mine = manifest["optimizer"]["type"], type(target.optimizer).__name__
        if saved != mine:
            raise CheckpointError(f"checkpoint '{path}' holds {saved} optimizer states but the engine's optimizer is "
                                  f"{mine}; use the same optimizer, or pass load_optimizer_states=False to start "
                                  f"it fresh")
        states = _optimizer_states(tensors)
        for _, pieces in plan.masters:
            for piece in pieces:
                for key in states.get(piece.origin.name, []):
                    need(f"optim/{key}/{piece.origin.name}", piece.origin, piece.start, piece.end)
    layout, dims = manifest["layout"], target.mesh.dims
    plan.same_layout = layout["world_size"] == dims.world_size and \
        all(layout.get(k, 1) == v for k, v in dims.layout().items())
    plan.files.add(_rank_entry(plan, target.mesh.rank)["file"])  # this rank's own states
    plan.files.add(manifest["ranks"][0]["file"])  # the tensors of the job's states and the client state
    for name, record in manifest["files"].items():
        problem = verify_file(path, name, record, check_hash=name in plan.files)
        if problem:
            raise CheckpointError(problem)
    return plan


def _optimizer_states(tensors: dict) -> dict[str, list[str]]:
    """{parameter name: the optimizer states stored for it}, from keys `optim/<state>/<name>`."""
    out: dict[str, list[str]] = {}
    for key in tensors:
        if key.startswith("optim/"):
            state, _, name = key[len("optim/"):].partition("/")
            out.setdefault(name, []).append(state)
    return {name: sorted(states) for name, states in out.items()}


def _rank_entry(plan: _Plan, rank: int) -> dict:
    """Whose per-rank states this rank gets back: its own under the same layout, rank 0's under another."""
    return plan.manifest["ranks"][rank if plan.same_layout else 0]


def resolve_tag(world, load_dir, tag) -> str | None:
    if tag is None:
        tag = read_latest(Path(load_dir))
    tags = comm.all_gather_object(tag, world, tag="checkpoint")
    if len(set(tags)) > 1:
        raise CheckpointError(f"ranks see different checkpoints to load in '{load_dir}' ({sorted(map(str, set(tags)))}"
                              f"): every rank must read the same directory (a shared file system) and tag")
    return tags[0]


STRICT_KEY = "with checkpoint.auto_resume: the config's checkpoint.load_module_strict = false"


def load_checkpoint(target: CheckpointTarget, load_dir, tag=None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True):
    """Load a checkpoint saved under any layout into `target` (its model, optimizer states when
    `load_optimizer_states`, and each of its stateful objects the checkpoint holds a state for); returns
    (path, client_state), or (None, None) when `load_dir` holds no complete checkpoint (DeepSpeed's contract).
    Collective over every rank."""
    rank, world = target.mesh.rank, target.mesh.world
    tag = resolve_tag(world, load_dir, tag)
    if tag is None:
        if rank == 0:
            log.warning("no checkpoint to load in '%s' (no '%s' file)", load_dir, "latest")
        return None, None
    path = tag_dir(Path(load_dir), str(tag))
    optimizer_states = load_optimizer_states
    plan, error = None, None
    try:
        plan = _plan(target, path, optimizer_states)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks, or they would hang
        error = f"checking checkpoint '{path}' failed on rank {rank}: {type(exc).__name__}: {exc}"
    everyone = comm.all_gather_object((error, sorted(plan.names) if plan else []), world, tag="checkpoint")
    errors = [e for e, _ in everyone if e]
    if errors:
        raise CheckpointError(errors[0])
    # saved without its frozen base: a strict load needs this model's to be it (non-strict keeps whatever it has)
    excluded = plan.manifest.get("frozen_excluded")
    if excluded is not None and load_module_strict:
        problem = fingerprint_problem(excluded["fingerprint"], frozen_fingerprint(target.model, target.mesh))
        if problem:
            raise CheckpointError(f"checkpoint '{path}' was saved without its frozen base "
                                  f"(exclude_frozen_parameters), and this model's base is not that base: {problem}; "
                                  f"build the model from the base the run started from (the same weights), or "
                                  f"pass load_module_strict=False ({STRICT_KEY}) to keep this model's frozen tensors "
                                  f"as they are")
    if load_module_strict:  # names over every rank (a pipeline stage alone does not hold the whole model)
        held = set().union(*(set(names) for _, names in everyone))
        held -= set(excluded["fingerprint"]) if excluded is not None else set()
        saved = {k[len("model/"):] for k in plan.manifest["tensors"] if k.startswith("model/")}
        missing, extra = sorted(held - saved), sorted(saved - held)
        if missing:
            raise CheckpointError(f"checkpoint '{path}' lacks {len(missing)} tensor(s) of this model: "
                                  f"{', '.join(missing[:8])}: it is of a different model; load a checkpoint of "
                                  f"this model, or pass load_module_strict=False ({STRICT_KEY}) to keep their current "
                                  f"values")
        if extra:
            raise CheckpointError(f"checkpoint '{path}' has {len(extra)} tensor(s) this model does not: "
                                  f"{', '.join(extra[:8])}: it is of a different model; load a checkpoint of this "
                                  f"model, or pass load_module_strict=False ({STRICT_KEY}) to ignore them")
    return str(path), _apply(target, plan, optimizer_states)


def _apply(target: CheckpointTarget, plan: _Plan, optimizer_states: bool):
    files = PieceFiles(plan.path)
    manifest = plan.manifest
    with torch.no_grad():
        for master, pieces in plan.masters:
            flat = master.detach().view(-1)
            for piece in pieces:
                flat[piece.offset:piece.offset + piece.end - piece.start] = plan.read(
                    files, piece.key, piece.origin, piece.start, piece.end, flat.dtype)
        for piece in plan.buffers:
            piece.write(plan.read(files, piece.key, piece.origin, piece.start, piece.end, piece.data.dtype))
        if optimizer_states and manifest["optimizer"] is not None:
            _load_optimizer(target.optimizer, plan, files)
    target.model.grad_sync.masters_loaded()
    first = manifest["ranks"][0]["file"]
    _load_states(target.states, manifest["states"], files, first)
    own = _rank_entry(plan, target.mesh.rank)
    _load_states(target.rank_states, own["states"], files, own["file"])
    if target.rank_states and not plan.same_layout and target.mesh.rank == 0:
        log.info("checkpoint '%s' was saved under layout %s: rank 0's per-rank states (random generators) are "
                 "given to every rank", plan.path, manifest["layout"]["describe"])
    return decode_state(manifest["client_state"], lambda key: files.tensor(first, key))


def _load_states(states: dict, saved: dict, files: PieceFiles, file: str) -> None:
    """Each stateful object the checkpoint holds a state for gets it back (tensors read from `file`)."""
    for name, obj in states.items():
        if saved.get(name) is not None:
            obj.load_state_dict(decode_state(saved[name], lambda key: files.tensor(file, key)))


def _load_optimizer(optimizer, plan: _Plan, files: PieceFiles) -> None:
    tensors = plan.manifest["tensors"]
    saved = plan.manifest["optimizer"]
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    states = _optimizer_states(tensors)
    names_of_group: dict[int, set[str]] = {}
    for master, pieces in plan.masters:
        names = [piece.origin.name for piece in pieces]
        names_of_group.setdefault(id(group_of[id(master)]), set()).update(names)
        state = {}
        for key in sorted({k for n in names for k in states.get(n, [])}):
            out = torch.zeros(master.shape, dtype=DTYPE_BY_NAME[tensors[f"optim/{key}/{names[0]}"]["dtype"]],
                              device=master.device)
            flat = out.view(-1)
            for piece in pieces:
                flat[piece.offset:piece.offset + piece.end - piece.start] = plan.read(
                    files, f"optim/{key}/{piece.origin.name}", piece.origin, piece.start, piece.end, flat.dtype)
            state[key] = out
        for key, per_param in saved["scalars"].items():
            entry = next((per_param[n] for n in names if n in per_param), None)
            if entry is not None:
                state[key] = scalar_value(entry, master, group_of[id(master)])
        optimizer.state.pop(master, None)
        if state:
            optimizer.state[master] = state
    for i, group in enumerate(optimizer.param_groups):
        mine = names_of_group.get(id(group), set())
        best = max(saved["groups"], key=lambda g: len(mine & set(g["params"])), default=None)
        if best is not None and not mine & set(best["params"]):
            best = saved["groups"][i] if i < len(saved["groups"]) else None
        if best is not None:
            restore_group_options(group, best["options"])
