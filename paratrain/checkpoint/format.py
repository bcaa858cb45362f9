"""The files of a checkpoint and how they are written durably and read without unpickling anything.

    DIR/latest                        the newest complete tag (one line, DeepSpeed's file)
    DIR/<tag>/manifest.json           written last: layout, config, engine state, every piece's coordinates,
                                      every file's size and sha256, and its own checksum
    DIR/<tag>/rank00003.safetensors   the pieces rank 3 owns, plus its random-generator states

[Note: durability order]
A rank writes its file to `<name>.tmp`, fsyncs it and renames it into `DIR/<tag>.partial/`. Once every rank
has done so, rank 0 writes the manifest the same way, fsyncs the directory, renames `<tag>.partial` to
`<tag>` (an atomic directory rename) and only then rewrites `latest` (temp, fsync, rename, fsync `DIR`).
A crash at any point leaves `latest` naming a complete checkpoint: the one before, or the new one.

Tensors are in the safetensors format (written by a streaming writer here, which hashes while it writes;
read with the `safetensors` library): loading never unpickles, so a checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import torch

from paratrain.errors import Error

FORMAT = "paratrain-checkpoint"
VERSION = 2  # 2: stateful objects' states under `states` and each rank's `states`
LATEST = "latest"
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"  # a tag being written
REPLACED_SUFFIX = ".replaced"  # the previous copy of a tag being overwritten, until the new one is in place

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64", torch.int64: "int64", torch.int32: "int32", torch.int16: "int16",
               torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}
DTYPE_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


class CheckpointError(Error, RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file or tensor and the fix."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or "/" in tag or "\\" in tag or tag.startswith(".") or tag == LATEST or \
            tag.endswith((PARTIAL_SUFFIX, REPLACED_SUFFIX)):
        raise CheckpointError(f"checkpoint tag {tag!r} is not a plain directory name; use letters, digits, '_', "
                              f"'-' (e.g. 'global_step100'), not '{LATEST}' and not ending in {PARTIAL_SUFFIX} or "
                              f"{REPLACED_SUFFIX}")
    return tag


def _raw_bytes(t: torch.Tensor):
    """The tensor's bytes in memory order, without a copy when it is a contiguous CPU tensor."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SafetensorsWriter:
    """One safetensors file written tensor by tensor, in the order of `entries` ((key, shape, dtype): the header
    needs no data), so a writer holds one tensor at a time; atomic (temp name, fsync, rename on `close`)."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None):
        header: dict = {}
        offset = 0
        for key, shape, dtype in entries:
            if dtype not in DTYPES:
                raise CheckpointError(f"tensor {key!r} has dtype {dtype}, which checkpoints do not store; "
                                      f"supported: {', '.join(DTYPE_NAMES.values())}")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.path, self.pending = path, [(k, tuple(shape), dtype) for k, shape, dtype in entries]
        self.bytes = 8 + len(raw) + offset
        self.digest = hashlib.sha256()
        self.tmp = path.with_name(path.name + ".tmp")
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed by close() or abort()
        for chunk in (struct.pack("<Q", len(raw)), raw):
            self._put(chunk)

    def _put(self, data) -> None:
        self.file.write(data)
        self.digest.update(data)

    def write(self, key: str, t: torch.Tensor) -> None:
        """The next tensor of the header (its key, shape and dtype must be the next entry's)."""
        want = self.pending.pop(0) if self.pending else None
        if want != (key, tuple(t.shape), t.dtype):
            self.abort()
            raise CheckpointError(f"internal error, please report: writing {key!r} {list(t.shape)} {t.dtype} to "
                                  f"'{self.path}' where the header expects {want}")
        self._put(_raw_bytes(t))

    def close(self) -> dict:
        """Finish the file; returns {"bytes", "sha256"} of it, computed while writing."""
        if self.pending:
            self.abort()
            raise CheckpointError(f"internal error, please report: '{self.path}' closed with {len(self.pending)} "
                                  f"tensor(s) unwritten")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        return {"bytes": self.bytes, "sha256": self.digest.hexdigest()}

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> dict:
    """Write `tensors` as one safetensors file, atomically (temp name, fsync, rename).

    Returns {"bytes", "sha256"} of the file, computed while writing.
    """
    writer = SafetensorsWriter(path, [(k, tuple(t.shape), t.dtype) for k, t in tensors], metadata)
    try:
        for key, t in tensors:
            writer.write(key, t)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_manifest(tag_dir: Path, manifest: dict) -> None:
    manifest = {**manifest, "checksum": hashlib.sha256(_canonical(manifest)).hexdigest()}
    atomic_write_text(tag_dir / MANIFEST, json.dumps(manifest, separators=(",", ":")))


def read_manifest(tag_dir: Path) -> dict:
    """The manifest of a complete checkpoint, checked for format, version and its own checksum."""
    path = tag_dir / MANIFEST
    if not tag_dir.is_dir():
        raise CheckpointError(f"checkpoint directory '{tag_dir}' does not exist; pass an existing directory (and "
                              f"tag), or save one first")
    if not path.is_file():
        raise CheckpointError(f"'{tag_dir}' has no {MANIFEST}: the checkpoint is incomplete (a save was "
                              f"interrupted) or not a paratrain checkpoint; load another tag")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"'{path}' is not valid JSON ({exc}): the manifest is corrupted; load another "
                              f"tag") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' is not a {FORMAT} manifest; load a checkpoint saved by paratrain")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"'{path}' has format version {manifest.get('version')!r}; this paratrain reads "
                              f"version {VERSION}")
    if manifest.get("checksum") != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise CheckpointError(f"'{path}' fails its checksum: the manifest was modified or corrupted; load "
                              f"another tag")
    return manifest


def read_latest(directory: Path) -> str | None:
    """The tag `latest` names, or None when the directory holds no complete checkpoint yet."""
    path = directory / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    return tag or None


def tag_dir(directory: Path, tag: str) -> Path:
    """The directory of `tag`. If a crash hit the moment an overwritten tag was swapped, the previous copy
    (`<tag>.replaced`) is the complete one."""
    path = directory / tag
    replaced = directory / (tag + REPLACED_SUFFIX)
    if not path.exists() and (replaced / MANIFEST).is_file():
        return replaced
    return path


def verify_file(tag_path: Path, name: str, record: dict, check_hash: bool) -> str | None:
    """None if `name` has the size (and, if asked, the sha256) the manifest records; else the problem."""
    path = tag_path / name
    if not path.is_file():
        return (f"checkpoint file '{path}' (rank {record.get('rank')}'s part) is missing; the checkpoint is "
                f"incomplete: restore the file or load another tag")
    size = path.stat().st_size
    if size != record["bytes"]:
        return (f"checkpoint file '{path}' has {size} bytes but the manifest records {record['bytes']}: it is "
                f"truncated or was overwritten; restore it or load another tag")
    if check_hash and sha256_file(path) != record["sha256"]:
        return (f"checkpoint file '{path}' fails its sha256 checksum: its contents are corrupted; restore it or "
                f"load another tag")
    return None
