"""Pretrained out: the model as a directory that `from_pretrained` loads, streamed from any layout.

    save_pretrained(parallel, mesh, device, "out", files={"config.json": ...}, max_shard_size="5GB")

    out/config.json                              the family's description files (`ModelSpec.pretrained_files`)
    out/model-00001-of-00003.safetensors ...     the tensors under their original names, in shards
    out/model.safetensors.index.json             {name: shard} (one shard: out/model.safetensors, no index)
    out/tokenizer*.json                          the tokenizer's own save_pretrained, when there is one

[Note: one tensor at a time]
The shards are planned from the pieces' descriptions alone (names, shapes, dtypes), so every file's header
is known before any data moves. Then, tensor by tensor in that order, the ranks that keep its pieces
broadcast them (one collective per piece), rank 0 assembles the tensor, appends it to the open shard
(`SafetensorsWriter`) and drops it: no rank ever holds more than one whole tensor. Rank 0 writes into
`.<name>.partial` beside the target and renames it into place once every file is fsynced, so a crash leaves
either the previous directory or the new one. A write error on rank 0 is held until the stream ends (the
other ranks are still sending) and then raised on every rank.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from paratrain.checkpoint.format import (
    CheckpointError,
    SafetensorsWriter,
    atomic_write_text,
    fsync_dir,
)
from paratrain.checkpoint.pieces import agree_on_pieces, model_pieces
from paratrain.checkpoint.reshard import Piece, read_full
from paratrain.comm import all_gather_object, broadcast
from paratrain.model_spec import ModelSpecError

INDEX = "model.safetensors.index.json"
WRITER = 0  # the rank that writes the files
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or Hugging Face's max_shard_size strings ("5GB" = 5e9, "500MiB" = 500 * 2**20)."""
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise CheckpointError(f"max_shard_size {size!r} is not a size; pass bytes (an int > 0) or a string such "
                              f"as '5GB' or '500MiB'")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


class FullTensorStream:
    """Every tensor of the model, whole, one at a time on rank `dst` (see the module's note). Built collectively
    (the ranks agree on the pieces); `tensors` lists (names, shape, dtype) in the order iteration yields them
    (a tied tensor has several names); iterating is collective too, and every rank must run it to the end:
    it yields (names, the whole tensor on `dst`, None elsewhere)."""

    def __init__(self, parallel, mesh, device: torch.device, dst: int = WRITER,
                 keep: Callable[[str], bool] | None = None, order: Callable[[str], object] | None = None):
        """`keep(name)`: stream only those tensors; `order(name)`: in this order (default: by name)."""
        self.mesh, self.device, self.dst = mesh, device, dst
        pieces = model_pieces(parallel)
        everyone, aliases = agree_on_pieces(pieces, parallel, mesh)
        self.mine = {(p.key, tuple(p.origin.offsets), p.start): p
                     for p, d in zip(pieces, (d for d in everyone if d["rank"] == mesh.rank)) if d["owned"]}
        by_key: dict[str, list[dict]] = {}
        for d in everyone:
            if d["owned"]:
                by_key.setdefault(d["key"], []).append(d)
        self.owned = {k: sorted(v, key=lambda d: (d["rank"], d["offsets"], d["start"])) for k, v in by_key.items()
                      if keep is None or keep(v[0]["name"])}
        self.keys = sorted(self.owned, key=lambda k: (order(self.owned[k][0]["name"]), k) if order else k)
        names_of: dict[str, list[str]] = {}
        for alias, name in aliases.items():
            names_of.setdefault(name, []).append(alias)
        self.tensors = []
        for key in self.keys:
            first = self.owned[key][0]
            self.tensors.append(([first["name"], *sorted(names_of.get(first["name"], []))], tuple(first["shape"]),
                                 getattr(torch, first["dtype"])))

    def __iter__(self) -> Iterator[tuple[list[str], torch.Tensor | None]]:
        for key, (names, shape, dtype) in zip(self.keys, self.tensors):
            yield names, self._gather(key, shape, dtype)

    def _gather(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        rank, world = self.mesh.rank, self.mesh.world
        received = {}
        for d in self.owned[key]:
            where = (key, tuple(d["offsets"]), d["start"])
            if d["rank"] == rank:
                flat = self.mine[where].data.to(self.device).reshape(-1).contiguous()
            else:
                flat = torch.empty(d["end"] - d["start"], dtype=dtype, device=self.device)
            broadcast(flat, world, src=d["rank"], tag="save_pretrained")
            if rank == self.dst:
                received[where] = flat
        if rank != self.dst:
            return None
        if not math.prod(shape):
            return torch.empty(shape, dtype=dtype)
        located = [Piece(str(d["rank"]), key, tuple(d["offsets"]), tuple(d["box"]), d["start"], d["end"])
                   for d in self.owned[key]]
        return read_full(located, lambda piece, lo, hi: received[(key, piece.offsets, piece.start)][lo:hi].cpu(),
                         shape, dtype)


def plan_shards(tensors: list[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int) -> list[list[int]]:
    """Indices of `tensors` per shard, in order: a shard takes tensors until the next would pass `max_bytes`
    (Hugging Face's rule; a tensor larger than that gets a shard of its own)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, dtype) in enumerate(tensors):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class ShardSink:
    """The shards of a plan, each opened when its first tensor arrives and closed after its last."""

    def __init__(self, directory: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int):
        self.directory, self.entries = directory, entries
        self.shards = plan_shards(entries, max_bytes)
        self.files = _shard_names(len(self.shards))
        self.shard_of = {entries[i][0]: s for s, shard in enumerate(self.shards) for i in shard}
        self.left = [len(shard) for shard in self.shards]
        self.writer: SafetensorsWriter | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        s = self.shard_of[name]
        if self.writer is None:
            self.writer = SafetensorsWriter(self.directory / self.files[s],
                                            [self.entries[i] for i in self.shards[s]], {"format": "pt"})
        self.writer.write(name, tensor)
        self.left[s] -= 1
        if not self.left[s]:
            self.writer.close()
            self.writer = None

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()

    def index(self) -> dict:
        total = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in self.entries)
        return {"metadata": {"total_size": total},
                "weight_map": {name: self.files[self.shard_of[name]] for name in sorted(self.shard_of)}}


def _target_problem(directory: Path) -> str | None:
    """Why `directory` cannot be (re)placed by a saved model: a file, or a directory of something else."""
    if directory.is_file():
        return f"'{directory}' is a file; pass a directory to save the model into"
    if directory.is_dir() and any(directory.iterdir()) and not (directory / "config.json").is_file():
        return (f"'{directory}' is not empty and holds no saved model (no config.json); save_pretrained replaces "
                f"the whole directory, so pass a new or empty one")
    return None


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():  # the tokenizer's files are written without fsync
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)


def publish(partial: Path, directory: Path) -> None:
    """Swap the finished `partial` in for `directory` (the previous copy is moved aside, then deleted)."""
    _fsync_tree(partial)
    if directory.exists():
        replaced = directory.with_name(f".{directory.name}.replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(directory, replaced)
        os.rename(partial, directory)
        fsync_dir(directory.parent)
        shutil.rmtree(replaced)
    else:
        os.rename(partial, directory)
        fsync_dir(directory.parent)


def _write_all(stream: FullTensorStream, partial: Path, sink: ShardSink | None, cast, merger=None) -> str | None:
    """Run the stream to its end (every rank); on the writer, write each tensor under each of its names (with a
    `merger`: what it makes of the tensor, under the name it gives). Returns the writer's first error (it keeps
    receiving after one, so no rank is left waiting)."""
    error = None
    for names, full in stream:
        if sink is not None and error is None:
            try:
                out = full if merger is None else merger.take(names[0], full)
                for name in names if out is not None else ():
                    sink.write(merger.rename(name) if merger else name, cast(out))
            except (OSError, CheckpointError) as exc:
                error = f"writing '{names[0]}' into '{partial}': {exc}"
                sink.abort()
        full = out = None  # dropped before the stream assembles the next one: one whole tensor at a time
    return error


def save_pretrained(parallel, mesh, device: torch.device, directory, model_config: dict | None, tokenizer=None,
                    max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None, merger=None) -> Path:
    """Write the model to `directory` (collective over the world; rank 0 writes): the family's files
    (`ModelSpec.pretrained_files` of `model_config`) beside its tensors in shards of at most `max_shard_size`,
    floating tensors cast to `dtype` if given, and the tokenizer's own files. A `merger`
    (`paratrain.checkpoint.adapters.Merger`) folds the adapters into their base weights on the way."""
    directory = Path(directory)
    max_bytes = parse_size(max_shard_size)
    if merger is not None and merger.dequantizes and model_config:  # a 4-bit base written in its compute dtype
        model_config = {k: v for k, v in model_config.items() if k != "quantization_config"}
    try:
        files = parallel.spec.pretrained_files(model_config, str(dtype or torch.float32).split(".")[-1])
    except ModelSpecError as exc:
        raise CheckpointError(str(exc)) from None
    world = mesh.world
    writer = mesh.rank == WRITER
    stream = FullTensorStream(parallel, mesh, device, order=merger.order if merger else None)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    rename = merger.rename if merger else (lambda name: name)
    written = merger.written if merger else (lambda name, shape, dt: (shape, dt))
    entries = [(rename(name), *_cast_entry(*written(name, shape, dt), cast)) for names, shape, dt in stream.tensors
               for name in names if rename(name) is not None]
    partial = directory.with_name(f".{directory.name}.partial")
    problem = _target_problem(directory) if writer else None
    if writer and problem is None:
        try:
            shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted save
            partial.mkdir(parents=True)
        except OSError as exc:
            problem = f"cannot create '{partial}': {exc}"
    problem = all_gather_object(problem, world, tag="save_pretrained")[WRITER]
    if problem:
        raise CheckpointError(f"save_pretrained refused, nothing was written: {problem}")
    sink = ShardSink(partial, entries, max_bytes) if writer else None
    error = _write_all(stream, partial, sink, cast, merger)
    if writer and error is None:
        try:
            if len(sink.files) > 1:
                atomic_write_text(partial / INDEX, json.dumps(sink.index(), indent=2) + "\n")
            for name, text in files.items():
                atomic_write_text(partial / name, text)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(partial))
            publish(partial, directory)
        except (OSError, ValueError) as exc:
            error = f"finishing '{directory}': {exc}"
    raise_on_every_rank(error, world, partial, f"save_pretrained to '{directory}'")
    return directory


def _cast_entry(shape: tuple, dtype: torch.dtype, cast) -> tuple[tuple, torch.dtype]:
    return shape, cast(torch.empty((), dtype=dtype)).dtype


def raise_on_every_rank(error: str | None, world, partial: Path, what: str) -> None:
    """The writer's error (or None) raised on every rank alike, its partial directory removed first."""
    error = all_gather_object(error, world, tag="save_pretrained")[WRITER]
    if error:
        if world.rank == WRITER:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"{what} failed: {error}")
