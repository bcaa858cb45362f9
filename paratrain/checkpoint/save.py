"""Saving: every rank writes the pieces it owns, in parallel; rank 0 writes the manifest, then `latest`.

[Note: who writes what]
Everything is stored per *original* tensor name (`ParallelModel.origin`), as pieces (`pieces.py`): a
tensor-parallel shard is a box of the full tensor, a ZeRO shard a flat range of that box
(`GradSync.master_segments`). Before anything is written every rank agrees that the pieces describe one
consistent model (shapes, placements, identical copies, exact coverage), so no rank can store its slice as a
whole tensor. A piece held identically by several ranks (DDP replicas over dp, parameters replicated over tp)
is written by exactly one of them: the rank whose index on each replicated axis is crc32(name) mod the axis
size, which spreads replicated tensors over the ranks instead of piling them on rank 0. Optimizer states (Adam's
exp_avg, exp_avg_sq, SGD's momentum) follow their parameter's pieces under `optim/<state>/<name>`; the
fp32 master weights are stored under `model/<name>`.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import paratrain.comm as comm
from paratrain.checkpoint.fingerprint import frozen_fingerprint
from paratrain.checkpoint.format import (
    DTYPE_NAMES,
    FORMAT,
    LATEST,
    MANIFEST,
    PARTIAL_SUFFIX,
    REPLACED_SUFFIX,
    VERSION,
    CheckpointError,
    atomic_write_text,
    check_tag,
    fsync_dir,
    rank_file,
    read_latest,
    write_manifest,
    write_safetensors,
)
from paratrain.checkpoint.pieces import HeldPiece, check_pieces, describe, model_pieces, owns, placement_problem
from paratrain.checkpoint.reshard import Piece, coverage_problem
from paratrain.checkpoint.state import encode_state, group_options, scalar_entry
from paratrain.checkpoint.target import CheckpointTarget
from paratrain.version import __version__

log = logging.getLogger("paratrain")

# Test-only: seconds each rank sleeps after writing its file, so a test can kill a job in the middle of a save.
PAUSE_ENV = "PARATRAIN_TEST_SAVE_PAUSE_S"
# Test-only: seconds each rank sleeps before writing its file, so that training moves on during an asynchronous save.
DELAY_ENV = "PARATRAIN_TEST_SAVE_DELAY_S"


def _collect(optimizer, file: str, pieces: list[HeldPiece], owned: list[bool]) -> tuple[list, dict, list]:
    """This rank's pieces to write (the model's and the optimizer states' of each piece it keeps, as (key, the
    live tensor, the shape to write it in)), what the manifest needs to know about them that training does not
    change, and the masters whose scalars it records [(master, original name, its element-wise states' names)]."""
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    sources, info = [], {"tensors": {}, "pieces": {}, "groups": {}}
    scalars_of: list[tuple[torch.Tensor, str, frozenset]] = []
    moments_of: dict[int, dict[str, torch.Tensor]] = {}

    def add(key: str, data: torch.Tensor, origin, start: int, end: int) -> None:
        # A piece that is a whole box keeps the box's shape (readable as is); a flat range stays 1-d.
        whole = start == 0 and end == math.prod(origin.local_shape)
        sources.append((key, data, tuple(origin.local_shape) if whole else (-1,)))
        info["tensors"][key] = {"shape": list(origin.shape), "dtype": DTYPE_NAMES[data.dtype]}
        info["pieces"][key] = Piece(file, key, origin.offsets, origin.local_shape, start, end).to_json()

    for piece, keep in zip(pieces, owned):
        origin, size = piece.origin, piece.end - piece.start
        if piece.master is None:  # a buffer or frozen parameter: no optimizer state
            if keep:  # a whole module tensor is read from it at each save (its flat `data` may be a copy)
                add(piece.key, piece.target if piece.target is not None else piece.data, origin, piece.start,
                    piece.end)
            continue
        state = optimizer.state.get(piece.master, {})
        if id(piece.master) not in moments_of:  # a master holds many pieces (ZeRO's flat buffers)
            moments_of[id(piece.master)] = _moments(state, piece.master, optimizer)
        moments = moments_of[id(piece.master)]
        index = str(group_of[id(piece.master)])
        info["groups"].setdefault(index, {"params": []})["params"].append(origin.name)
        if not keep:
            continue
        add(piece.key, piece.data, origin, piece.start, piece.end)
        for k, v in moments.items():
            add(f"optim/{k}/{origin.name}", v[piece.offset:piece.offset + size], origin, piece.start, piece.end)
        scalars_of.append((piece.master, origin.name, frozenset(moments)))
    return sources, info, scalars_of


def _moments(state: dict, master: torch.Tensor, optimizer) -> dict[str, torch.Tensor]:
    """The element-wise optimizer states of one master, flat (refused when one is not element-wise)."""
    moments = {k: v.detach().reshape(-1) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim()}
    for k, v in moments.items():
        if v.numel() != master.numel():
            raise CheckpointError(f"optimizer state '{k}' has {v.numel()} elements but its parameter "
                                  f"{master.numel()}: {type(optimizer).__name__} keeps states that are not "
                                  f"element-wise, which sharded checkpoints cannot split")
    return moments


def _encode_states(states: dict, tensors: dict[str, torch.Tensor], prefix: str) -> dict:
    return {name: encode_state(obj.state_dict(), tensors, f"{prefix}/{name}", f"the state of '{name}'")
            for name, obj in states.items()}


def _agreed_tag(tags: list[str], policy: str) -> str:
    if len(set(tags)) > 1 and policy != "Ignore":
        message = f"ranks passed different checkpoint tags to save_checkpoint: {sorted(set(tags))}"
        if policy == "Fail":
            raise CheckpointError(f"{message}; pass the same tag on every rank (checkpoint.tag_validation: Fail)")
        log.warning("%s; using rank 0's %r", message, tags[0])
    return tags[0]


@dataclass
class StagedSave:
    """One rank's part of a save, taken at the call without a collective: what it writes, what the manifest needs
    from it, its pieces' descriptions (checked against every rank's before anything is written) and the input
    error it found, if any. With `copy` the tensors are this rank's own copies in host memory, so training may go
    on while they are written."""

    target: CheckpointTarget
    directory: Path
    tag: str
    tensors: list[tuple[str, torch.Tensor]]
    summary: dict
    described: list[dict]
    problem: str | None  # this rank's: bad input (a tag, a state), or a piece located wrongly
    save_latest: bool
    frozen: dict | None

    @property
    def partial(self) -> Path:
        return self.directory / (self.tag + PARTIAL_SUFFIX)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


def save_checkpoint(target: CheckpointTarget, save_dir, tag: str, client_state=None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> Path:
    """Write a complete checkpoint of `target` to `save_dir/tag` (collective over every rank). Frozen
    parameters are left out with `exclude_frozen_parameters` (load such a checkpoint with
    load_module_strict=False)."""
    # the base left out: what it was, so that resuming on another base is refused (checkpoint/fingerprint.py)
    frozen = frozen_fingerprint(target.model, target.mesh) if exclude_frozen_parameters else None
    staged = stage_save(target, save_dir, tag, client_state, save_latest, frozen, copy=False)
    return write_staged(staged, target.mesh.world)


@dataclass
class SavePlan:
    """What a rank's save takes from the live objects that training does not change, worked out once: its pieces,
    which of them it writes, their descriptions, the rank file's tensors (views of the live ones) and the static
    part of what the manifest needs. It holds while `signature` does (the masters and the optimizer's element-wise
    states, by identity: the first step creates those states, a load may replace them); the engine also drops it
    on any load, which may replace the module's buffers or frozen tensors."""

    excludes_frozen: bool
    pieces: list[HeldPiece]
    described: list[dict]
    problem: str | None  # bad input found while planning (a piece located wrongly, a state that is not element-wise)
    sources: list[tuple[str, torch.Tensor, tuple]]  # (key, live tensor, the shape it is written in)
    views: list[tuple[str, torch.Tensor]]  # the sources in the shapes they are written in (`stale`: copies)
    stale: list[int]  # the sources whose reshape is a copy (a non-contiguous module tensor): read at each save
    info: dict
    scalars_of: list[tuple[torch.Tensor, str, frozenset]]
    signature: tuple

    def holds(self, target: CheckpointTarget, excludes_frozen: bool) -> bool:
        return excludes_frozen == self.excludes_frozen and _signature(target) == self.signature


def _signature(target: CheckpointTarget) -> tuple:
    state, sync = target.optimizer.state, target.model.grad_sync
    return tuple((id(m), m.data_ptr(), tuple((k, id(v)) for k, v in state.get(m, {}).items()
                                             if isinstance(v, torch.Tensor) and v.dim()))
                 for m, _ in sync.master_segments())


def plan_save(target: CheckpointTarget, excludes_frozen: bool) -> SavePlan:
    """This rank's `SavePlan` (no collective)."""
    mesh, parallel = target.mesh, target.model
    pieces = model_pieces(parallel)
    if excludes_frozen:
        pieces = [p for p in pieces if not p.frozen]
    owned = [owns(p.origin, p.copies, mesh) for p in pieces]
    described = [describe(p, keep, mesh.rank) for p, keep in zip(pieces, owned)]
    problem, sources, info, scalars_of = placement_problem(pieces, parallel), [], {}, []
    try:
        sources, info, scalars_of = _collect(target.optimizer, rank_file(mesh.rank), pieces, owned)
    except CheckpointError as exc:
        problem = f"rank {mesh.rank}: {exc}"
    views = [(key, t.detach().reshape(shape)) for key, t, shape in sources]
    stale = [i for i, ((_, t, _), (_, v)) in enumerate(zip(sources, views))
             if v.numel() and v.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()]
    return SavePlan(excludes_frozen, pieces, described, problem, sources, views, stale, info, scalars_of,
                    _signature(target))


def _read(plan: SavePlan, copy: bool) -> list[tuple[str, torch.Tensor]]:
    """The plan's tensors: views of the live ones, or (`copy`) this rank's own copy of them in host memory."""
    live = list(plan.views)
    for i in plan.stale:
        key, t, shape = plan.sources[i]
        live[i] = (key, t.detach().reshape(shape))
    return [(key, t.to("cpu", copy=True)) for key, t in live] if copy else live


def _changing(target: CheckpointTarget, plan: SavePlan) -> dict:
    """What the manifest needs that training changes: each group's options (a schedule's lr) and each kept
    master's scalars (Adam's step)."""
    optimizer = target.optimizer
    groups = {i: {"options": group_options(optimizer.param_groups[int(i)]), "params": g["params"]}
              for i, g in plan.info["groups"].items()}
    scalars: dict[str, dict] = {}
    for master, name, moments in plan.scalars_of:
        for k, v in optimizer.state.get(master, {}).items():
            if k not in moments and v is not None:
                scalars.setdefault(k, {})[name] = scalar_entry(v, f"'{k}' of '{name}'")
    return {"groups": groups, "scalars": scalars}


def stage_save(target: CheckpointTarget, save_dir, tag: str, client_state, save_latest: bool,
               frozen_fingerprint: dict | None, copy: bool, plan: SavePlan | None = None) -> StagedSave:
    """Everything a save reads from the live objects, on this rank alone (no collective). `frozen_fingerprint`:
    the base's (`fingerprint.py`) when the frozen parameters are left out, else None. `copy`: the tensors are
    copied to host memory (an asynchronous save). `plan`: this rank's `SavePlan`, when it still holds."""
    mesh = target.mesh
    if plan is None:
        plan = plan_save(target, frozen_fingerprint is not None)
    # copies replicated over a model-parallel axis are compared by their values' digests: taken now
    described = [describe(p, d["owned"], mesh.rank) if d["digest"] is not None else d
                 for p, d in zip(plan.pieces, plan.described)]
    problem, tensors = plan.problem, []
    summary: dict = {"rank": mesh.rank, "file": rank_file(mesh.rank), "coords": dict(mesh.coords)}
    try:
        check_tag(tag)
        if problem is None:
            summary.update(plan.info, **_changing(target, plan))
            tensors = _read(plan, copy)
        extra: dict[str, torch.Tensor] = {}  # the tensors inside states and client state
        summary["rank_states"] = _encode_states(target.rank_states, extra, "rank_state")
        if mesh.rank == 0:
            summary["states"] = _encode_states(target.states, extra, "state")
            summary["client_state"] = encode_state(client_state if client_state is not None else {}, extra,
                                                   "client", "client_state")
        # `copy`: this rank's own copy, as the optimizer may change the live tensors while the copy is written
        tensors += [(key, t.detach().to("cpu", copy=True) if copy else t) for key, t in extra.items()]
    except CheckpointError as exc:
        problem, tensors = problem or f"rank {mesh.rank}: {exc}", []
    frozen = {"fingerprint": frozen_fingerprint} if frozen_fingerprint is not None else None
    return StagedSave(target, Path(save_dir), str(tag), tensors, summary, described, problem, save_latest, frozen)


def _agree(staged: StagedSave, axis) -> None:
    """One gather over `axis`: every rank's tag, input problem and pieces; the same error on every rank, before
    anything is written, when any is wrong. Sets the agreed tag."""
    target = staged.target
    gathered = comm.all_gather_object((staged.tag, staged.problem, staged.described), axis, tag="checkpoint")
    problem = next((p for _, p, _ in gathered if p), None)
    if problem is None:
        problem = check_pieces([d for _, _, part in gathered for d in part], target.model.explain)
    if problem:
        raise CheckpointError(f"saving checkpoint '{staged.tag}' in '{staged.directory}' refused, nothing was "
                              f"written: {problem}")
    staged.tag = _agreed_tag([t for t, _, _ in gathered], target.config.checkpoint.tag_validation)


def write_staged(staged: StagedSave, axis) -> Path:
    """Check and write a staged save: every rank its file, then rank 0 the manifest, the rename and `latest`
    (collective over `axis`, every rank: the world's, or an asynchronous save's own group). Bad input raises before
    anything is written; a failure while writing removes the partial directory; either raises on every rank."""
    _agree(staged, axis)
    target, directory, tag = staged.target, staged.directory, staged.tag
    if target.mesh.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staged.partial, ignore_errors=True)  # left by an interrupted save of the same tag
        staged.partial.mkdir()
    comm.barrier(axis)
    summary = dict(staged.summary, error=None)
    try:
        if os.environ.get(DELAY_ENV):
            time.sleep(float(os.environ[DELAY_ENV]))
        summary["record"] = write_safetensors(staged.partial / summary["file"], staged.tensors)
        if os.environ.get(PAUSE_ENV):
            time.sleep(float(os.environ[PAUSE_ENV]))
    except (CheckpointError, OSError) as exc:
        summary["error"] = f"rank {target.mesh.rank}: {exc}"
    everyone = comm.all_gather_object(summary, axis, tag="checkpoint")
    error = next((s["error"] for s in everyone if s["error"]), None)
    if error is None and target.mesh.rank == 0:
        try:
            _publish(target, directory, tag, staged.partial, everyone, staged.save_latest, staged.frozen)
        except (CheckpointError, OSError) as exc:
            error = f"rank 0: {exc}"
    error = comm.all_gather_object(error, axis, tag="checkpoint")[0] or error
    if error:
        if target.mesh.rank == 0:
            shutil.rmtree(staged.partial, ignore_errors=True)
        comm.barrier(axis)  # no rank raises before the partial directory is gone: its caller may look at the disk
        raise CheckpointError(f"saving checkpoint '{tag}' in '{directory}' failed: {error}")
    if target.mesh.rank == 0:
        log.info("saved checkpoint %s", directory / tag)
    return directory / tag


def _manifest(target: CheckpointTarget, tag: str, everyone: list[dict], frozen: dict | None = None) -> dict:
    tensors, pieces, scalars, groups = {}, {}, {}, {}
    for s in everyone:
        tensors.update(s["tensors"])
        for key, piece in s["pieces"].items():
            pieces.setdefault(key, []).append(piece)
        for k, per_param in s["scalars"].items():
            scalars.setdefault(k, {}).update(per_param)
        for gi, g in s["groups"].items():
            merged = groups.setdefault(gi, {"options": g["options"], "params": []})
            merged["params"] += [n for n in g["params"] if n not in merged["params"]]
    for key in sorted(pieces):
        problem = coverage_problem(key, tuple(tensors[key]["shape"]), [Piece.from_json(p) for p in pieces[key]])
        if problem:
            raise CheckpointError(f"internal error, please report: {problem}")
    dims, config = target.mesh.dims, target.config
    return {
        "format": FORMAT, "version": VERSION, "tag": tag, "created": time.time(), "paratrain_version": __version__,
        "torch_version": torch.__version__,
        "layout": {"world_size": dims.world_size, **dims.layout(), "describe": dims.describe(),
                   "zero_stage": config.zero_optimization.stage, "precision": config.precision,
                   "gradient_accumulation_steps": config.gradient_accumulation_steps,
                   "train_batch_size": config.train_batch_size},
        "config": config.model_dump(mode="json"),
        "model": {"family": target.model.spec.name,
                  **({"config": target.model_config} if target.model_config is not None else {})},
        "states": everyone[0]["states"],
        "optimizer": {"type": type(target.optimizer).__name__, "groups": [groups[k] for k in sorted(groups, key=int)],
                      "scalars": scalars},
        "client_state": everyone[0]["client_state"],
        "frozen_excluded": frozen,  # exclude_frozen_parameters: the base's fingerprint (None: the base is in)
        "tensors": dict(sorted(tensors.items())),
        "pieces": dict(sorted(pieces.items())),
        "files": {s["file"]: {"rank": s["rank"], **s["record"]} for s in everyone},
        "ranks": [{"rank": s["rank"], "coords": s["coords"], "file": s["file"], "states": s["rank_states"]}
                  for s in everyone],
    }


def _publish(target: CheckpointTarget, directory: Path, tag: str, partial: Path, everyone: list[dict],
             save_latest: bool, frozen: dict | None = None) -> None:
    """Rank 0, once every rank's file is durable: manifest, atomic rename of the tag, then `latest`."""
    write_manifest(partial, _manifest(target, tag, everyone, frozen))
    fsync_dir(partial)
    final = directory / tag
    if final.exists():  # overwrite: move the old copy aside (tag_dir() falls back to it), swap, delete it
        replaced = directory / (tag + REPLACED_SUFFIX)
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
        os.rename(partial, final)
        fsync_dir(directory)
        shutil.rmtree(replaced)
    else:
        os.rename(partial, final)
        fsync_dir(directory)
    if save_latest:
        atomic_write_text(directory / LATEST, tag + "\n")
    keep = target.config.checkpoint.keep_last
    if keep:
        _prune(directory, keep)


def _prune(directory: Path, keep: int) -> None:
    """Delete all but the `keep` most recently saved complete tags (never the one `latest` names)."""
    latest = read_latest(directory)
    complete = [p for p in directory.iterdir() if p.is_dir() and (p / MANIFEST).is_file() and
                not p.name.endswith((PARTIAL_SUFFIX, REPLACED_SUFFIX))]
    complete.sort(key=lambda p: (p / MANIFEST).stat().st_mtime, reverse=True)
    for old in complete[keep:]:
        if old.name != latest:
            shutil.rmtree(old, ignore_errors=True)
