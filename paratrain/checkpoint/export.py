"""Reading a checkpoint in one process, without torch.distributed: consolidated tensors, export, convert.

    reader = CheckpointReader("ckpts")                # the tag `latest` names (or "ckpts/global_step100")
    state = reader.model_state()                      # {original name: full fp32 tensor}
    export_safetensors(reader, "model.safetensors")   # one file any safetensors reader loads
    convert(reader, "ckpts-single")                   # a checkpoint with one rank holding every tensor whole
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from paratrain.checkpoint.format import (
    DTYPE_BY_NAME,
    LATEST,
    MANIFEST,
    PARTIAL_SUFFIX,
    CheckpointError,
    atomic_write_text,
    check_tag,
    fsync_dir,
    rank_file,
    read_latest,
    read_manifest,
    tag_dir,
    verify_file,
    write_manifest,
    write_safetensors,
)
from paratrain.checkpoint.load import PieceFiles
from paratrain.checkpoint.reshard import Piece, coverage_problem, read_full
from paratrain.checkpoint.state import tensor_keys
from paratrain.layout.mesh import ParallelDims
from paratrain.model_spec import ModelSpecError, spec_named


def resolve_path(path, tag: str | None = None) -> Path:
    """A tag directory from `DIR` (+ `tag`, default the one `latest` names) or `DIR/TAG` itself."""
    path = Path(path)
    if tag is None and (path / MANIFEST).is_file():
        return path
    if tag is None:
        tag = read_latest(path)
        if tag is None:
            raise CheckpointError(f"'{path}' has neither a {MANIFEST} nor a '{LATEST}' file: pass a checkpoint "
                                  f"directory that holds a complete checkpoint, or DIR/TAG")
    return tag_dir(path, tag)


class CheckpointReader:
    """One checkpoint, verified (sizes, and sha256 unless `verify=False`), read piece by piece."""

    def __init__(self, path, tag: str | None = None, verify: bool = True):
        self.path = resolve_path(path, tag)
        self.manifest = read_manifest(self.path)
        for name, record in self.manifest["files"].items():
            problem = verify_file(self.path, name, record, check_hash=verify)
            if problem:
                raise CheckpointError(problem)
        self.pieces = {k: [Piece.from_json(p) for p in v] for k, v in self.manifest["pieces"].items()}
        for key, pieces in self.pieces.items():
            problem = coverage_problem(key, self.shape(key), pieces)
            if problem:
                raise CheckpointError(f"checkpoint '{self.path}': {problem}")
        self.files = PieceFiles(self.path)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.manifest["tensors"][key]["shape"])

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor `key` (e.g. "model/head.weight", "optim/exp_avg/head.weight")."""
        dtype = DTYPE_BY_NAME[self.manifest["tensors"][key]["dtype"]]
        return read_full(self.pieces[key], self.files.fetch, self.shape(key), dtype)

    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict (fp32 master weights for trained parameters) under the original names."""
        return {k[len("model/"):]: self.tensor(k) for k in self.manifest["tensors"] if k.startswith("model/")}


def export_safetensors(reader: CheckpointReader, out, hf: bool = False, dtype: torch.dtype | None = None,
                       n_head: int | None = None) -> dict[str, torch.Tensor]:
    """Write the consolidated model to one safetensors file (`hf`: Hugging Face names, by the model family's
    spec, with a config.json beside it; `out` a directory: out/model.safetensors). Floating tensors are cast
    to `dtype` if given. Returns what was written."""
    state = reader.model_state()
    metadata = {"format": "pt", "source": str(reader.path),
                "global_steps": str((reader.manifest["states"].get("train") or {}).get("global_steps"))}
    out = Path(out)
    if hf and out.suffix != ".safetensors":  # a model directory, as from_pretrained loads it
        out = out / "model.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    if hf:
        # Checkpoints name their model family; older ones are of the built-in GPT, the only family they had.
        model = reader.manifest.get("model", {})
        family = model.get("family", "gpt")
        try:
            state, config = spec_named(family).to_hugging_face(state, reader.manifest["config"], n_head=n_head,
                                                               model_config=model.get("config"))
        except ModelSpecError as exc:
            raise CheckpointError(f"--hf: {exc}") from None
        atomic_write_text(out.parent / "config.json", json.dumps(config, indent=2) + "\n")
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    write_safetensors(out, list(state.items()), metadata)
    return state


def convert(reader: CheckpointReader, out_dir, tag: str | None = None) -> Path:
    """Write the checkpoint again as a single-rank one: every tensor whole in rank00000.safetensors, with rank 0's
    random states. Any layout loads it (as it loads any checkpoint); one process needs nothing else."""
    m = reader.manifest
    tag = check_tag(tag or m["tag"])
    directory = Path(out_dir)
    final = directory / tag
    if final.exists():
        raise CheckpointError(f"'{final}' already exists; choose another output directory or --tag")
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / (tag + PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    file = rank_file(0)
    tensors, pieces = [], {}
    for key in m["tensors"]:
        shape = reader.shape(key)
        tensors.append((key, reader.tensor(key)))
        pieces[key] = [Piece(file, key, (0,) * len(shape), shape, 0, math.prod(shape)).to_json()]
    first = m["ranks"][0]  # its file holds the tensors of rank 0's states, the job's states and the client state
    keys = tensor_keys([first["states"], m["states"], m["client_state"]])
    extra = [(k, reader.files.tensor(first["file"], k)) for k in keys]
    record = write_safetensors(partial / file, tensors + extra)
    layout = {**m["layout"], "world_size": 1, **ParallelDims(1).layout(), "describe": "single process"}
    manifest = {**m, "tag": tag, "layout": layout, "pieces": pieces, "files": {file: {"rank": 0, **record}},
                "ranks": [{**first, "rank": 0, "coords": ParallelDims(1).grid_coords(0), "file": file}]}
    manifest.pop("checksum", None)
    write_manifest(partial, manifest)
    fsync_dir(partial)
    os.rename(partial, final)
    fsync_dir(directory)
    atomic_write_text(directory / LATEST, tag + "\n")
    return final

