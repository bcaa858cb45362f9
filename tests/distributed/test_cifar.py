"""The CIFAR-10 reader on fixtures written in both official formats, its checks, and the example."""

from __future__ import annotations

import io
import json
import pickle
import tarfile

import numpy as np
import pytest
import torch

from paratrain.data.cifar import CifarError, load_cifar10, write_binary_batch, write_python_batch
from tests.distributed.test_cli import ROOT, _free_port, _paratrain  # noqa: I001


def _fixture(n: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), [int(x) for x in rng.integers(0, 10, n)]


def _write_py(folder, batches):
    folder.mkdir(parents=True)
    for name, (images, labels) in batches.items():
        write_python_batch(folder / name, images, labels)


def test_python_format_roundtrip(tmp_path):
    batches = {f"data_batch_{i}": _fixture(4, i) for i in range(1, 6)} | {"test_batch": _fixture(3, 9)}
    _write_py(tmp_path / "cifar-10-batches-py", batches)
    images, labels = load_cifar10(tmp_path, train=True, verify=False)
    assert images.shape == (20, 3, 32, 32) and images.dtype == torch.uint8
    assert torch.equal(images[:4], torch.from_numpy(batches["data_batch_1"][0]))
    assert labels.tolist() == sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    test_images, _ = load_cifar10(tmp_path, train=False, verify=False)
    assert test_images.shape[0] == 3


def test_binary_format_and_archive(tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    batches = {f"data_batch_{i}": _fixture(2, i) for i in range(1, 6)} | {"test_batch": _fixture(5, 7)}
    for name, (images, labels) in batches.items():
        write_binary_batch(folder / f"{name}.bin", images, labels)
    images, labels = load_cifar10(tmp_path, train=False, verify=False)
    assert torch.equal(images, torch.from_numpy(batches["test_batch"][0]))
    assert labels.tolist() == batches["test_batch"][1]
    # the same files read from the official archive name, in place
    archive_dir = tmp_path / "a"
    archive_dir.mkdir()
    with tarfile.open(archive_dir / "cifar-10-binary.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-bin")
    images2, _ = load_cifar10(archive_dir, train=False, verify=False)
    assert torch.equal(images, images2)


def test_checks_catch_corruption_and_refuse_code(tmp_path):
    _write_py(tmp_path / "cifar-10-batches-py", {"test_batch": _fixture(2)})
    with pytest.raises(CifarError, match="test_batch fails its MD5 check"):
        load_cifar10(tmp_path, train=False, verify=True)
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({b"data": io.StringIO("x")}))
    with pytest.raises(CifarError, match="refusing to unpickle _io.StringIO"):
        load_cifar10(tmp_path, train=False, verify=False)
    binary = tmp_path / "b" / "cifar-10-batches-bin"
    binary.mkdir(parents=True)
    (binary / "test_batch.bin").write_bytes(b"\x01" * 3000)
    with pytest.raises(CifarError, match="not a whole number of 3073-byte records"):
        load_cifar10(tmp_path / "b", train=False, verify=False)
    with pytest.raises(CifarError, match="no CIFAR-10 under .*cifar-10-python.tar.gz"):
        load_cifar10(tmp_path / "nothing", train=True)


@pytest.mark.multiprocess
def test_cifar_example_falls_back_to_digits_and_learns(tmp_path):
    run = _paratrain("run", "--nproc-per-node", "2", "--master-port", _free_port(),
                     str(ROOT / "examples" / "cifar10" / "train.py"), "--epochs", "2", "--data-dir", str(tmp_path),
                     "--metrics", "m.json", cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["data"].startswith("scikit-learn digits (fallback: no CIFAR-10 under")
    assert metrics["accuracy"] > 0.6  # ten classes: chance is 0.1
    assert "Accuracy of          0" in run.stdout


@pytest.mark.multiprocess
def test_cifar_example_with_zero2_and_bf16(tmp_path):
    run = _paratrain("run", "--nproc-per-node", "2", "--master-port", _free_port(),
                     str(ROOT / "examples" / "cifar10" / "train.py"), "--epochs", "1", "--stage", "2", "--dtype",
                     "bf16", "--data-dir", str(tmp_path), "--metrics", "m.json", cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert (metrics["zero_stage"], metrics["bf16"]) == (2, True)
    assert "ZeRO stage 2, bf16=True, fp16=False" in run.stdout and "Finished Training" in run.stdout
    assert metrics["steps"] > 20 and metrics["accuracy"] > 0.3  # one epoch of bf16 ZeRO-2 learns (chance: 0.1)
