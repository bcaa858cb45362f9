"""`paratrain.testing.HostSyncs` sees every way Python code reads a tensor's value, methods and free functions
alike, at the line that made it; reads declared as host memory are counted apart."""

from __future__ import annotations

import torch

from paratrain.data.host import host_reads
from paratrain.testing import HostSyncs

T = torch.tensor([1.0, 0.0, 2.0])
ORIGINALS = (torch.equal, torch.nonzero, torch.Tensor.item, torch.Tensor.nonzero)


def _reads() -> list:
    return [T[0].item(), float(T[0]), int(T[2]), bool(T[0]), T.tolist(), T.numpy(), T.cpu(), range(T[2].long()),
            f"{T[0]:.2f}", 1.0 in T,  # torch's __format__ and __contains__ reach item()
            torch.equal(T, T), T.equal(T), torch.allclose(T, T), T.allclose(T), torch.is_nonzero(T[0]),
            torch.nonzero(T), T.nonzero(), torch.argwhere(T), torch.masked_select(T, T > 0), T.masked_select(T > 0),
            torch.unique(T), T.unique(), torch.unique_consecutive(T)]


def test_every_read_is_counted_once_at_its_line():
    with HostSyncs(package="tests") as syncs:
        reads = _reads()
    assert syncs.total == len(reads) == 23, dict(syncs.sites)
    assert {site.split(" at ")[0] for site in syncs.sites} == {
        "item", "__float__", "__int__", "__bool__", "tolist", "numpy", "cpu", "__index__", "torch.equal", "equal",
        "torch.allclose", "allclose", "torch.is_nonzero", "torch.nonzero", "nonzero", "torch.argwhere",
        "torch.masked_select", "masked_select", "torch.unique", "unique", "torch.unique_consecutive"}
    assert all("tests/unit/test_host_sync_counter.py:" in site for site in syncs.sites), dict(syncs.sites)
    assert (torch.equal, torch.nonzero, torch.Tensor.item, torch.Tensor.nonzero) == ORIGINALS  # put back on exit


def test_reads_of_host_memory_are_counted_apart():
    with HostSyncs(package="tests") as syncs:
        with host_reads():
            torch.equal(T, T)
            bool(T[0])
        T.tolist()
    assert sum(syncs.host_sites.values()) == 2 and syncs.total == 1, (dict(syncs.sites), dict(syncs.host_sites))
