"""Weights on disk, read region by region: safetensors files (one file, a directory, a Hugging Face sharded
directory with `model.safetensors.index.json`) and paratrain checkpoints.

    source = open_weights("llama-8b/", name_map={"transformer.wte.weight": "model.embed_tokens.weight"})
    fill_model(parallel, mesh, source, names=source.names())

Nothing is read until `fill`, and then only the rows of each tensor that a rank's regions cover
(`safe_open(...).get_slice`), so no rank holds a whole tensor it does not keep. `elements_read` counts what
was read, for the tests that hold this to account.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from paratrain.checkpoint.export import CheckpointReader
from paratrain.checkpoint.format import DTYPE_BY_NAME, MANIFEST, CheckpointError
from paratrain.checkpoint.reshard import read_region
from paratrain.checkpoint.weights import Region, WeightsError, read_box_range

INDEX = "model.safetensors.index.json"
NameMap = Mapping[str, str] | Callable[[str], str | None] | None
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _map_name(name_map: NameMap, name: str) -> str | None:
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name, name)


def _check_fits(name: str, shape: tuple, dtype: torch.dtype, regions: list[Region], where: str) -> None:
    want = regions[0].origin.shape
    if tuple(shape) != tuple(want):
        raise WeightsError(f"'{name}' has shape {list(shape)} in {where} but {list(want)} in this model: the weights "
                           f"are of a different model (or need a name_map); use weights of this model")
    target = regions[0].dest.dtype
    if dtype.is_floating_point != target.is_floating_point or (dtype == torch.bool) != (target == torch.bool):
        raise WeightsError(f"'{name}' is {dtype} in {where} but {target} in this model: a "
                           f"{'floating-point' if dtype.is_floating_point else 'integer'} tensor cannot fill it")


def _truncation(path: Path) -> str | None:
    """Why a safetensors file is shorter than its header says, or None (checked before anything is read)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"'{path}' is truncated ({size} bytes): not even a safetensors header"
        (length,) = struct.unpack("<Q", head)
        raw = f.read(length)
    if len(raw) < length:
        return f"'{path}' is truncated: its header needs {length} bytes, the file has {size}"
    try:
        header = json.loads(raw)
    except ValueError:
        return f"'{path}' has a corrupted header (not JSON)"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        return f"'{path}' is truncated: its tensors need {8 + length + end} bytes, the file has {size}"
    return None


class SafetensorsSource:
    def __init__(self, path, name_map: NameMap = None):
        self.path = Path(path)
        files = self._files()
        for file in files:
            problem = _truncation(file)
            if problem:
                raise WeightsError(f"{problem}; copy the file again")
        self.entries: dict[str, tuple[Path, str, tuple[int, ...], torch.dtype]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                    name = _map_name(name_map, key)
                    if name is None:
                        continue
                    sl = f.get_slice(key)
                    self.entries[name] = (file, key, tuple(sl.get_shape()), _ST_DTYPES[sl.get_dtype()])
        self.elements_read = 0

    def _files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            files = sorted({self.path / f for f in weight_map.values()})
            absent = [str(f) for f in files if not f.is_file()]
            if absent:
                raise WeightsError(f"'{self.path / INDEX}' names shard(s) that are not there: {', '.join(absent)}")
            return files
        files = sorted(self.path.glob("*.safetensors")) if self.path.is_dir() else []
        if not files:
            raise WeightsError(f"'{self.path}' holds no weights: pass a .safetensors file, a directory of them (a "
                               f"Hugging Face model directory), or a paratrain checkpoint directory")
        return files

    def names(self) -> set[str]:
        return set(self.entries)

    def check(self, regions: dict[str, list[Region]]) -> None:
        missing = sorted(n for n in regions if n not in self.entries)
        if missing:
            raise WeightsError(f"the weights in '{self.path}' lack {len(missing)} tensor(s) of this model: "
                               f"{', '.join(missing[:8])}; map their names (name_map) or load other weights")
        for name, rs in regions.items():
            _, _, shape, dtype = self.entries[name]
            _check_fits(name, shape, dtype, rs, f"'{self.path}'")

    def fill(self, regions: dict[str, list[Region]]) -> list[str]:
        by_file: dict[Path, list[str]] = {}
        for name in regions:
            by_file.setdefault(self.entries[name][0], []).append(name)
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    _, key, shape, _ = self.entries[name]
                    sl = f.get_slice(key)

                    def read(index, sl=sl):
                        part = sl[index] if index else sl[:]
                        self.elements_read += part.numel()
                        return part

                    for r in regions[name]:
                        r.dest.copy_(read_box_range(read, shape, r.origin, r.start, r.end, r.dest.dtype))
        return []


class CheckpointSource:
    """The model weights of a paratrain checkpoint (any layout): only the pieces a region overlaps are read."""

    def __init__(self, path, name_map: NameMap = None):
        self.reader = CheckpointReader(path)
        self.path = self.reader.path
        self.entries: dict[str, str] = {}
        for key in self.reader.manifest["tensors"]:
            if key.startswith("model/"):
                name = _map_name(name_map, key[len("model/"):])
                if name is not None:
                    self.entries[name] = key
        self.elements_read = 0

    def names(self) -> set[str]:
        return set(self.entries)

    def check(self, regions: dict[str, list[Region]]) -> None:
        missing = sorted(n for n in regions if n not in self.entries)
        if missing:
            raise WeightsError(f"checkpoint '{self.path}' lacks {len(missing)} tensor(s) of this model: "
                               f"{', '.join(missing[:8])}; map their names (name_map) or load other weights")
        for name, rs in regions.items():
            info = self.reader.manifest["tensors"][self.entries[name]]
            _check_fits(name, tuple(info["shape"]), DTYPE_BY_NAME[info["dtype"]], rs, f"checkpoint '{self.path}'")

    def fill(self, regions: dict[str, list[Region]]) -> list[str]:
        def fetch(piece, lo: int, hi: int) -> torch.Tensor:  # counts what is read from the files
            part = self.reader.files.fetch(piece, lo, hi)
            self.elements_read += part.numel()
            return part

        for name, rs in regions.items():
            key = self.entries[name]
            shape = self.reader.shape(key)
            for r in rs:
                o = r.origin
                r.dest.copy_(read_region(self.reader.pieces[key], fetch, shape, o.offsets, o.local_shape, r.start,
                                         r.end, r.dest.dtype))
        return []


def open_weights(path, name_map: NameMap = None):
    """The source for `path`: a paratrain checkpoint (a directory with a manifest or a `latest` file) or
    safetensors weights."""
    p = Path(path)
    if not os.path.exists(p):
        raise WeightsError(f"weights path '{p}' does not exist")
    if p.is_dir() and ((p / MANIFEST).is_file() or (p / "latest").is_file()):
        try:
            return CheckpointSource(p, name_map)
        except CheckpointError as exc:
            raise WeightsError(str(exc)) from None
    return SafetensorsSource(p, name_map)


def elements_of(regions: dict[str, list[Region]]) -> int:
    """How many elements the regions hold (what a perfect reader would read)."""
    return sum(r.end - r.start for rs in regions.values() for r in rs)
