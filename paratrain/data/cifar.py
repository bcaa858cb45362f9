"""CIFAR-10 from local files in either official format, with integrity checks and no code unpickling.

Accepted under `data_dir`: the extracted `cifar-10-batches-py/` (python pickles) or `cifar-10-batches-bin/`
(binary records), or the official archives `cifar-10-python.tar.gz` / `cifar-10-binary.tar.gz`, read in place.
Official files are checked against their published MD5 sums; the binary format's per-file sums are not
published, so its records are checked structurally (10,000 records of 1 + 3072 bytes, labels < 10).

[Note: restricted unpickling] The python format is a pickle. A pickle can run any code, so it is read with
an Unpickler that resolves only the numpy globals an ndarray needs; anything else is refused.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import torch

from paratrain.errors import Error

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
PY_MD5 = {"data_batch_1": "c99cafc152244af753f735de768cd75f", "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
          "data_batch_3": "54ebc095f3ab1f0389bbae665268c751", "data_batch_4": "634d18415352ddfa80567beed471001a",
          "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb", "test_batch": "40351d587109b95175f43aff81a1287e",
          "batches.meta": "5ff9c542aee3614f3951f8cda6e48888"}
ARCHIVE_MD5 = {"cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a",
               "cifar-10-binary.tar.gz": "c32a1d4ab5d03f1284b67883e8d87530"}
TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
TEST = ["test_batch"]
HOW_TO_GET = ("download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz (163 MB) on a machine with "
              "internet access and copy it (or its extracted cifar-10-batches-py/ folder) into --data-dir")


class CifarError(Error, ValueError):
    pass


class _ArrayOnlyUnpickler(pickle.Unpickler):
    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                ("numpy._core.multiarray", "scalar"),
                ("_codecs", "encode")}  # protocol-2 pickles spell bytes as _codecs.encode(str, "latin1")

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise CifarError(f"refusing to unpickle {module}.{name}: a CIFAR-10 batch holds only arrays, lists and "
                         f"bytes; the file is not an official CIFAR-10 batch")


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


class _Source:
    """Files of one CIFAR-10 copy: a folder or a tar archive, python or binary format."""

    def __init__(self, data_dir: Path, verify: bool):
        self.verify = verify
        self.tar = None
        for archive, fmt in (("cifar-10-python.tar.gz", "py"), ("cifar-10-binary.tar.gz", "bin")):
            folder = data_dir / f"cifar-10-batches-{fmt}"
            if folder.is_dir():
                self.format, self.root = fmt, folder
                return
            if (data_dir / archive).is_file():
                raw = (data_dir / archive).read_bytes()
                if verify and _md5(raw) != ARCHIVE_MD5[archive]:
                    raise CifarError(f"{data_dir / archive} fails its MD5 check (corrupt or partial download); "
                                     f"download it again")
                self.format, self.root = fmt, Path(f"cifar-10-batches-{fmt}")
                self.tar = tarfile.open(fileobj=io.BytesIO(raw))  # noqa: SIM115 - in memory, read below
                return
        raise CifarError(f"no CIFAR-10 under {data_dir}: expected cifar-10-batches-py/, cifar-10-batches-bin/ or "
                         f"one of {', '.join(ARCHIVE_MD5)}; {HOW_TO_GET}")

    def read(self, name: str) -> bytes:
        if self.tar is not None:
            member = self.tar.extractfile(str(self.root / name))
            if member is None:
                raise CifarError(f"{name} is missing from the archive")
            return member.read()
        path = self.root / name
        if not path.is_file():
            raise CifarError(f"{path} is missing; {HOW_TO_GET}")
        return path.read_bytes()


def _python_batch(source: _Source, name: str) -> tuple[np.ndarray, np.ndarray]:
    raw = source.read(name)
    if source.verify and _md5(raw) != PY_MD5[name]:
        raise CifarError(f"{name} fails its MD5 check (expected {PY_MD5[name]}): the file is corrupt or not the "
                         f"official release; download it again (or pass verify=False for your own files)")
    batch = _ArrayOnlyUnpickler(io.BytesIO(raw), encoding="bytes").load()
    data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    return data, labels


def _binary_batch(source: _Source, name: str) -> tuple[np.ndarray, np.ndarray]:
    raw = np.frombuffer(source.read(f"{name}.bin"), dtype=np.uint8)
    if raw.size % 3073:
        raise CifarError(f"{name}.bin has {raw.size} bytes, not a whole number of 3073-byte records; the file is "
                         f"truncated or corrupt")
    records = raw.reshape(-1, 3073)
    if source.verify and records.shape[0] != 10000:
        raise CifarError(f"{name}.bin has {records.shape[0]} records; the official files have 10000")
    labels = records[:, 0].astype(np.int64)
    if labels.max(initial=0) >= 10:
        raise CifarError(f"{name}.bin has a label {labels.max()} >= 10; the file is corrupt")
    return records[:, 1:].reshape(-1, 3, 32, 32).copy(), labels


def load_cifar10(data_dir: str | Path, train: bool = True, verify: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 (N, 3, 32, 32), labels int64 (N,)) of the train or test split."""
    source = _Source(Path(data_dir), verify)
    read = _python_batch if source.format == "py" else _binary_batch
    parts = [read(source, name) for name in (TRAIN if train else TEST)]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return torch.from_numpy(images), torch.from_numpy(labels)


def write_python_batch(path: Path, images: np.ndarray, labels: list[int]) -> None:
    """Write a batch in the official python format (used to build test fixtures)."""
    payload = {b"batch_label": b"fixture", b"labels": list(labels), b"data": images.reshape(len(labels), -1),
               b"filenames": [f"img{i}.png".encode() for i in range(len(labels))]}
    path.write_bytes(pickle.dumps(payload, protocol=2))


def write_binary_batch(path: Path, images: np.ndarray, labels: list[int]) -> None:
    """Write a batch in the official binary format: per record, 1 label byte then 3072 pixel bytes."""
    records = np.concatenate([np.asarray(labels, dtype=np.uint8)[:, None], images.reshape(len(labels), -1)], axis=1)
    path.write_bytes(records.astype(np.uint8).tobytes())
