"""Decoding's small tensor-parallel collectives through shared memory (`paratrain.comm.host_reduce`): the same
sums and gathers as gloo's, bit for bit on two ranks; a payload over the capacity still goes through gloo; nothing is
left on disk; a rank that cannot map the file (another machine or container under the same host name) sends every
rank back to gloo; and a rank that never arrives ends its peer's wait with the guard's report, not a hang."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytestmark = pytest.mark.multiprocess


def _mesh():
    from paratrain.comm.groups import build_mesh
    from paratrain.layout.mesh import ParallelDims

    return build_mesh(ParallelDims(2, tp=2))


def _same_as_gloo() -> dict:
    import torch.distributed as dist

    import paratrain.comm as comm
    from paratrain.comm.collectives import HOST_SLOTS
    from paratrain.comm.host_reduce import host_collectives

    axis = _mesh().axis("tp")
    g = torch.Generator().manual_seed(dist.get_rank())
    sizes = (1, 7, 1000, 8192, 70000)  # 70,000 floats = 280 KB: under the 1 MiB capacity
    xs = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 4, (n,), generator=g) for n in sizes]
    by_gloo, by_host = [x.clone() for x in xs], [x.clone() for x in xs]
    for t in by_gloo:
        comm.all_reduce(t, axis)
    gathered_gloo = [torch.empty_like(xs[2]) for _ in range(2)]
    comm.all_gather_list(gathered_gloo, xs[2], axis)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(a[0].numel()) or real(*a, **k)
    try:
        with torch.no_grad(), host_collectives(axis, capacity=1 << 20):
            active = axis.ranks in HOST_SLOTS
            path = HOST_SLOTS[axis.ranks].path
            for t in by_host:
                comm.all_reduce(t, axis)
            gathered_host = [torch.empty_like(xs[2]) for _ in range(2)]
            comm.all_gather_list(gathered_host, xs[2], axis)
            big = torch.ones(300_000)  # 1.2 MB: over the capacity, through gloo
            comm.all_reduce(big, axis)
    finally:
        dist.all_reduce = real
    comm.barrier(axis)  # rank 0 has removed the file
    return {"active": active, "left_on_disk": os.path.exists(path), "after": axis.ranks in HOST_SLOTS,
            "equal": [bool(torch.equal(a, b)) for a, b in zip(by_gloo, by_host)],
            "gather_equal": all(torch.equal(a, b) for a, b in zip(gathered_gloo, gathered_host)),
            "gloo_calls": calls, "big": float(big[0])}


def _one_rank_cannot_map() -> tuple[bool, float]:
    import torch.distributed as dist

    import paratrain.comm as comm
    from paratrain.comm import host_reduce
    from paratrain.comm.collectives import HOST_SLOTS

    axis = _mesh().axis("tp")
    real = host_reduce.HostSlots
    if dist.get_rank() == 1:
        host_reduce.HostSlots = lambda *args: (_ for _ in ()).throw(OSError("no such file here"))
    try:
        with torch.no_grad(), host_reduce.host_collectives(axis):
            active = axis.ranks in HOST_SLOTS
            value = torch.full((3,), float(dist.get_rank() + 1))
            comm.all_reduce(value, axis)
    finally:
        host_reduce.HostSlots = real
    return active, float(value[0])


def _one_rank_stays_away() -> str:
    import torch.distributed as dist

    import paratrain.comm as comm
    from paratrain.comm.host_reduce import host_collectives

    mesh = _mesh()
    mesh.guard.configure(timeout_s=1.0, report_dir=tempfile.mkdtemp())
    axis = mesh.axis("tp")
    with torch.no_grad(), host_collectives(axis):
        if dist.get_rank() == 1:
            return "stayed away"
        try:
            comm.all_reduce(torch.ones(4), axis)
        except comm.CollectiveTimeout as exc:
            return str(exc)
    return "no error"


def test_host_collectives_are_gloos_sums_and_gathers(world2):
    for r in world2.run(_same_as_gloo):
        assert r["active"] and not r["after"], r
        assert not r["left_on_disk"], r
        assert all(r["equal"]) and r["gather_equal"], r
        assert r["gloo_calls"] == [300_000] and r["big"] == 2.0, r  # only the payload over the capacity


def test_a_rank_that_cannot_map_the_file_sends_every_rank_back_to_gloo(world2):
    assert world2.run(_one_rank_cannot_map) == [(False, 3.0), (False, 3.0)]


def test_a_rank_that_never_arrives_ends_the_wait_with_the_guard_report(world2):
    away, waiting = sorted(world2.run(_one_rank_stays_away), key=lambda m: m != "stayed away")
    assert away == "stayed away"
    assert "ranks [1] never wrote shared-memory collective #1" in waiting, waiting
    assert "in all_reduce #1 on axis 'tp'" in waiting and "comm.timeout_s = 1" in waiting, waiting
