"""The nested-structure walkers (torch.utils._pytree underneath): containers keep their types, tensors are
handled, everything else passes through untouched."""

import torch

from paratrain.data import default_collate
from paratrain.data.nested import tensors_in as _tensors
from paratrain.data.nested import to_device as _to_device
from paratrain.parallel.dp.dp import _gather, _has_empty, _scatter

MARKER = object()


def _batch():
    return {"ids": torch.arange(6).reshape(3, 2), "pair": (torch.ones(3), [torch.zeros(3, 1), 7]), "tag": MARKER}


def test_to_device_keeps_containers_and_non_tensors():
    batch = _batch()
    moved = _to_device(batch, torch.device("cpu"))
    assert type(moved) is dict and list(moved) == ["ids", "pair", "tag"]
    assert type(moved["pair"]) is tuple and type(moved["pair"][1]) is list
    assert moved["tag"] is MARKER and moved["pair"][1][1] == 7
    assert torch.equal(moved["ids"], batch["ids"]) and torch.equal(moved["pair"][1][0], batch["pair"][1][0])


def test_tensors_lists_every_tensor_in_order():
    batch = _batch()
    assert [t.shape for t in _tensors(batch)] == [(3, 2), (3,), (3, 1)]
    assert _tensors(MARKER) == [] and len(_tensors(torch.ones(1))) == 1


def test_scatter_splits_tensors_and_replicates_the_rest():
    devices = [torch.device("cpu")] * 2
    parts = _scatter(_batch(), devices, dim=0)
    assert len(parts) == 2
    assert [p["ids"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5]]]
    assert all(type(p["pair"]) is tuple and type(p["pair"][1]) is list and p["tag"] is MARKER for p in parts)
    assert [p["pair"][1][1] for p in parts] == [7, 7]


def test_scatter_marks_devices_without_a_chunk_empty():
    parts = _scatter(((torch.ones(1, 2),), {}), [torch.device("cpu")] * 3, dim=0)
    assert [_has_empty(p) for p in parts] == [False, True, True]
    assert parts[1] == ((None,), {})


def test_gather_concatenates_tensors_stacks_scalars_and_lists_the_rest():
    outputs = [{"out": (torch.ones(2, 1), torch.tensor(1.0)), "n": [i]} for i in range(2)]
    gathered = _gather(outputs, torch.device("cpu"), dim=0)
    assert type(gathered) is dict and type(gathered["out"]) is tuple and type(gathered["n"]) is list
    assert gathered["out"][0].shape == (4, 1) and gathered["out"][1].tolist() == [1.0, 1.0]
    assert gathered["n"] == [[0, 1]]


def test_default_collate_stacks_every_leaf():
    samples = [{"x": torch.full((2,), float(i)), "y": [i, (torch.tensor(i),)]} for i in range(3)]
    batch = default_collate(samples)
    assert type(batch) is dict and type(batch["y"]) is list and type(batch["y"][1]) is tuple
    assert batch["x"].shape == (3, 2) and batch["y"][0].tolist() == [0, 1, 2]
    assert batch["y"][1][0].tolist() == [0, 1, 2]
    x, y = default_collate([(torch.ones(4), torch.zeros(4)) for _ in range(5)])
    assert x.shape == y.shape == (5, 4)
