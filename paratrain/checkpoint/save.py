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
from paratrain.checkpoint.pieces import HeldPiece, agree_on_pieces, model_pieces
from paratrain.checkpoint.reshard import Piece, coverage_problem
from paratrain.checkpoint.state import encode_state, group_options, scalar_entry
from paratrain.checkpoint.target import CheckpointTarget
from paratrain.version import __version__

log = logging.getLogger("paratrain")

# Test-only: seconds each rank sleeps after writing its file, so a test can kill a job in the middle of a save.
PAUSE_ENV = "PARATRAIN_TEST_SAVE_PAUSE_S"


def _collect(optimizer, file: str, pieces: list[HeldPiece], owned: list[bool]) -> tuple[list, dict]:
    """This rank's pieces to write (the model's and the optimizer states' of each piece it keeps) and what the
    manifest needs to know about them."""
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    tensors, info = [], {"tensors": {}, "pieces": {}, "scalars": {}, "groups": {}}

    def add(key: str, data: torch.Tensor, origin, start: int, end: int) -> None:
        # A piece that is a whole box keeps the box's shape (readable as is); a flat range stays 1-d.
        whole = start == 0 and end == math.prod(origin.local_shape)
        tensors.append((key, data.reshape(origin.local_shape) if whole else data.reshape(-1)))
        info["tensors"][key] = {"shape": list(origin.shape), "dtype": DTYPE_NAMES[data.dtype]}
        info["pieces"][key] = Piece(file, key, origin.offsets, origin.local_shape, start, end).to_json()

    for piece, keep in zip(pieces, owned):
        origin, size = piece.origin, piece.end - piece.start
        if piece.master is None:  # a buffer or frozen parameter: no optimizer state
            if keep:
                add(piece.key, piece.data, origin, piece.start, piece.end)
            continue
        state = optimizer.state.get(piece.master, {})
        moments = _moments(state, piece.master, optimizer)
        group = info["groups"].setdefault(str(group_of[id(piece.master)]), {
            "options": group_options(optimizer.param_groups[group_of[id(piece.master)]]), "params": []})
        group["params"].append(origin.name)
        if not keep:
            continue
        add(piece.key, piece.data, origin, piece.start, piece.end)
        for k, v in moments.items():
            add(f"optim/{k}/{origin.name}", v[piece.offset:piece.offset + size], origin, piece.start, piece.end)
        for k, v in state.items():
            if k not in moments and v is not None:
                info["scalars"].setdefault(k, {})[origin.name] = scalar_entry(v, f"'{k}' of '{origin.name}'")
    return tensors, info


def _moments(state: dict, master: torch.Tensor, optimizer) -> dict[str, torch.Tensor]:
    """The element-wise optimizer states of one master, flat (refused when one is not element-wise)."""
    moments = {k: v.detach().reshape(-1) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim()}
    for k, v in moments.items():
        if v.numel() != master.numel():
            raise CheckpointError(f"optimizer state '{k}' has {v.numel()} elements but its parameter "
                                  f"{master.numel()}: {type(optimizer).__name__} keeps states that are not "
                                  f"element-wise, which sharded checkpoints cannot split")
    return moments


def _pieces_to_save(target: CheckpointTarget, exclude_frozen: bool) -> tuple[list[HeldPiece], list[bool]]:
    """This rank's model pieces, agreed with every rank's and checked for consistency (collective; raises the
    same error everywhere before anything is written) and which of them this rank writes."""
    parallel = target.model
    pieces = model_pieces(parallel)
    if exclude_frozen:
        pieces = [p for p in pieces if not p.frozen]
    everyone, _ = agree_on_pieces(pieces, parallel, target.mesh)
    mine = [d["owned"] for d in everyone if d["rank"] == target.mesh.rank]
    return pieces, mine


def _encode_states(states: dict, tensors: dict[str, torch.Tensor], prefix: str) -> dict:
    return {name: encode_state(obj.state_dict(), tensors, f"{prefix}/{name}", f"the state of '{name}'")
            for name, obj in states.items()}


def _agree_on_tag(tag: str, world, policy: str) -> str:
    tags = comm.all_gather_object(tag, world, tag="checkpoint")
    if len(set(tags)) > 1 and policy != "Ignore":
        message = f"ranks passed different checkpoint tags to save_checkpoint: {sorted(set(tags))}"
        if policy == "Fail":
            raise CheckpointError(f"{message}; pass the same tag on every rank (checkpoint.tag_validation: Fail)")
        log.warning("%s; using rank 0's %r", message, tags[0])
    return tags[0]


@dataclass
class StagedSave:
    """One rank's part of a save, taken at the call: what it writes and what the manifest needs from it. With
    `copy` the tensors are this rank's own copies in host memory, so training may go on while they are written."""

    target: CheckpointTarget
    directory: Path
    tag: str
    tensors: list[tuple[str, torch.Tensor]]
    summary: dict
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
    staged = stage_save(target, save_dir, tag, client_state, save_latest, exclude_frozen_parameters, copy=False)
    return write_staged(staged, target.mesh.world)


def stage_save(target: CheckpointTarget, save_dir, tag: str, client_state, save_latest: bool,
               exclude_frozen_parameters: bool, copy: bool) -> StagedSave:
    """Everything a save reads from the live objects (collective over every rank; raises the same error on every
    rank before anything is written). `copy`: the tensors are copied to host memory (an asynchronous save)."""
    mesh, world = target.mesh, target.mesh.world
    tag = _agree_on_tag(check_tag(tag), world, target.config.checkpoint.tag_validation)
    try:
        pieces, owned = _pieces_to_save(target, exclude_frozen_parameters)
        # the base left out: what it was, so that resuming on another base is refused (checkpoint/fingerprint.py)
        frozen = {"fingerprint": frozen_fingerprint(target.model, mesh)} if exclude_frozen_parameters else None
    except CheckpointError as exc:
        raise CheckpointError(f"saving checkpoint '{tag}' in '{save_dir}' refused, nothing was written: "
                              f"{exc}") from None
    file, error = rank_file(mesh.rank), None
    summary: dict = {"rank": mesh.rank, "file": file, "coords": dict(mesh.coords)}
    tensors: list = []
    try:
        tensors, info = _collect(target.optimizer, file, pieces, owned)
        extra: dict[str, torch.Tensor] = {}  # the tensors inside states and client state
        summary["rank_states"] = _encode_states(target.rank_states, extra, "rank_state")
        if mesh.rank == 0:
            summary["states"] = _encode_states(target.states, extra, "state")
            summary["client_state"] = encode_state(client_state if client_state is not None else {}, extra,
                                                   "client", "client_state")
        summary.update(info)
        tensors += list(extra.items())
    except CheckpointError as exc:
        error = f"rank {mesh.rank}: {exc}"
    error = next((e for e in comm.all_gather_object(error, world, tag="checkpoint") if e), None)
    if error:
        raise CheckpointError(f"saving checkpoint '{tag}' in '{save_dir}' refused, nothing was written: {error}")
    if copy:  # this rank's own copy: the optimizer may change the live tensors while the copy is written
        tensors = [(key, t.detach().to("cpu", copy=True)) for key, t in tensors]
    staged = StagedSave(target, Path(save_dir), tag, tensors, summary, save_latest, frozen)
    if mesh.rank == 0:
        staged.directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staged.partial, ignore_errors=True)  # left by an interrupted save of the same tag
        staged.partial.mkdir()
    comm.barrier(world)
    return staged


def write_staged(staged: StagedSave, axis) -> Path:
    """Write a staged save: every rank its file, then rank 0 the manifest, the rename and `latest` (collective over
    `axis`, every rank: the world's, or an asynchronous save's own group). A failure anywhere removes the partial
    directory and raises on every rank."""
    target, directory, tag = staged.target, staged.directory, staged.tag
    summary = dict(staged.summary, error=None)
    try:
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
