"""The checkpoint's file format and piece arithmetic, in one process: safetensors compatibility, checksums,
and reading any region of a tensor from the pieces another layout wrote (TP boxes x ZeRO flat ranges)."""

from __future__ import annotations

import hashlib
import itertools
import json

import pytest
import torch
from safetensors import safe_open

from paratrain.checkpoint.format import (
    VERSION,
    CheckpointError,
    check_tag,
    read_manifest,
    sha256_file,
    write_manifest,
    write_safetensors,
)
from paratrain.checkpoint.reshard import Piece, coverage_problem, read_full, read_region, valid_count


def test_streamed_safetensors_are_read_by_the_safetensors_library(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
               ("c", torch.arange(6, dtype=torch.int64).view(2, 3)), ("d", torch.tensor(2.5)),
               ("e", torch.zeros(0, 4)), ("f", torch.tensor([True, False])), ("g", torch.randn(4).half()),
               ("h", torch.randn(5, 5, generator=g)[:, 1])]  # non-contiguous input
    record = write_safetensors(tmp_path / "x.safetensors", tensors, {"note": "hi"})
    path = tmp_path / "x.safetensors"
    assert record == {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    assert record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert not (tmp_path / "x.safetensors.tmp").exists()
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"note": "hi"}
        for key, t in tensors:
            got = f.get_tensor(key)
            assert got.dtype == t.dtype and torch.equal(got, t), key
        assert torch.equal(f.get_slice("a")[1:3], tensors[0][1][1:3])


def test_manifest_checksum_and_tag_names(tmp_path):
    write_manifest(tmp_path, {"format": "paratrain-checkpoint", "version": VERSION, "x": [1, 2]})
    assert read_manifest(tmp_path)["x"] == [1, 2]
    raw = json.loads((tmp_path / "manifest.json").read_text())
    raw["x"] = [1, 3]
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="fails its checksum: the manifest was modified or corrupted"):
        read_manifest(tmp_path)
    for bad in ("", "a/b", ".hidden", "latest", "x.partial", "x.replaced"):
        with pytest.raises(CheckpointError, match="is not a plain directory name"):
            check_tag(bad)
    assert check_tag("global_step7") == "global_step7"


def test_valid_count_matches_a_mask():
    for box, limits in [((4, 5), (3, 5)), ((3, 4, 2), (2, 3, 2)), ((6,), (4,)), ((2, 3), (2, 3)), ((), ())]:
        mask = torch.ones(box, dtype=torch.bool)
        for d, lim in enumerate(limits):
            index = [slice(None)] * len(box)
            index[d] = slice(lim, None)
            mask[tuple(index)] = False
        flat = mask.reshape(-1)
        n = flat.numel()
        for start, end in itertools.combinations(range(n + 1), 2):
            assert valid_count(box, limits, start, end) == int(flat[start:end].sum()), (box, start, end)


def _pieces(full: torch.Tensor, split_dim: int, parts: int, zero: int, name: str):
    """Store `full` the way a tp=`parts` x ZeRO-`zero`-ranks layout does: boxes along `split_dim` (the last
    one padded past the end when uneven), each box's flat range cut into `zero` ranges."""
    local = -(-full.shape[split_dim] // parts)
    stored, pieces = {}, []
    for r in range(parts):
        offsets = [0] * full.dim()
        offsets[split_dim] = r * local
        box = list(full.shape)
        box[split_dim] = local
        padded = torch.zeros(box)
        src = full.narrow(split_dim, r * local, max(0, min(local, full.shape[split_dim] - r * local)))
        padded.narrow(split_dim, 0, src.shape[split_dim]).copy_(src)
        numel, chunk = padded.numel(), -(-padded.numel() // zero)
        for z in range(zero):
            start, end = min(numel, z * chunk), min(numel, (z + 1) * chunk)
            if start < end:
                key = f"{name}/{r}/{z}"
                stored[key] = padded.reshape(-1)[start:end].clone()
                pieces.append(Piece("f", key, tuple(offsets), tuple(box), start, end))
    return stored, pieces


@pytest.mark.parametrize("save,load", [((0, 4, 3), (1, 2, 2)), ((1, 2, 1), (0, 4, 2)), ((0, 1, 4), (0, 4, 1)),
                                       ((0, 4, 2), (0, 4, 3))])
def test_read_any_region_from_another_layouts_pieces(save, load):
    full = torch.randn(10, 6)  # 10 rows over 4 parts: padded to 12, the last box half padding
    stored, pieces = _pieces(full, *save, "w")
    assert coverage_problem("w", tuple(full.shape), pieces) is None
    fetch = lambda p, lo, hi: stored[p.key][lo:hi]
    assert torch.equal(read_full(pieces, fetch, tuple(full.shape), torch.float32), full)
    dim, parts, zero = load
    want, wanted = _pieces(full, dim, parts, zero, "want")
    for p in wanted:  # every region the new layout needs, padding included (zero)
        got = read_region(pieces, fetch, tuple(full.shape), p.offsets, p.box, p.start, p.end, torch.float32)
        assert torch.equal(got, want[p.key]), p


def test_coverage_finds_a_missing_piece():
    _, pieces = _pieces(torch.randn(5, 3), 0, 2, 2, "w")  # boxes of 3 rows; the last piece is row 4 + padding
    assert coverage_problem("w", (5, 3), pieces) is None
    assert coverage_problem("w", (5, 3), pieces[:-1]) == ("tensor 'w': its pieces hold 14 of its 15 elements; the "
                                                          "checkpoint is incomplete")
