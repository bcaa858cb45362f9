"""Small all-reduces and all-gathers of one host's ranks through a shared mapping, for token-by-token decoding.

A tensor-parallel decode makes two all-reduces per layer per token, each of a few kilobytes. On gloo every one is
a round trip through the loopback stack and the backend's threads, more than a millisecond on a 2-core machine —
more than the arithmetic of a small model (docs/benchmarks.md, "rollout": a tp2 rollout batch went from 657 to
191 ms with this path and the one-position logits). When every rank of the axis is on one host, the ranks can
instead meet in shared memory (DeepSpeed's CPU inference does the same): each writes its tensor into its own slot
and then raises its flag to the call's number, waits until every flag has reached it, and sums the slots in rank
order (or, for a gather, reads them in order), so every rank computes the same sum. Two sets of slots, used by odd
and even calls, let a rank that has finished call n write call n + 1 while slower ranks still read call n; it
cannot reach call n + 2 before every rank has raised its flag for n + 1, which each does only after reading call n.

Exactness: for two ranks a + b is gloo's sum bit for bit (addition commutes); for more, rank order may round
differently from gloo's ring, within the floats' last bits.

Used only inside `host_collectives(axis)` (the engine's decoding); only when every rank maps the creator's file and
finds its mark there (a host name shared by two machines or containers falls back to gloo); only on x86-64, whose
stores are seen in the order they were made, so a peer that sees a flag sees the data written before it (elsewhere
gloo is kept); only for payloads up to `capacity` bytes (a long prompt's forward still goes through gloo); and only
with no gradient to carry. A wait is bounded by the comm guard's timeout, looks for a failed peer as the guard's
waits do, and ends in the guard's report naming the call.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import tempfile
import time

import torch

from paratrain.comm.collectives import HOST_SLOTS, all_gather_object
from paratrain.layout.mesh import Axis

CAPACITY = 1 << 20  # bytes per rank slot: a decode step's activations (rows x hidden), not a prompt's
FLAG_STRIDE = 64  # bytes between two ranks' flags (one cache line each)
SPINS_BEFORE_YIELD = 64
CHECK_EVERY_S = 0.05  # how often a long wait looks at the clock and for a failed peer


class HostSlots:
    """One axis's mapping: a flag per rank, then two sets (odd and even calls) of a slot per rank."""

    def __init__(self, axis: Axis, path: str, capacity: int) -> None:
        self.axis, self.capacity, self.calls, self.path = axis, capacity, 0, path
        self.header = (1 + axis.size) * FLAG_STRIDE  # the creator's mark, then a flag per rank
        self.mapping = torch.from_file(path, shared=True, size=self.nbytes(axis.size, capacity), dtype=torch.uint8)
        lines = self.mapping[:self.header].view(torch.int64)[::FLAG_STRIDE // 8]
        self.mark, self.flags = lines[0], lines[1:]

    @staticmethod
    def nbytes(ranks: int, capacity: int) -> int:
        return (1 + ranks) * FLAG_STRIDE + 2 * ranks * capacity

    def fits(self, tensor: torch.Tensor) -> bool:
        return (tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.requires_grad
                and tensor.numel() * tensor.element_size() <= self.capacity)

    def _slots(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot of this call as `tensor`'s shape and dtype, after writing this rank's and waiting for
        every rank's."""
        self.calls += 1
        size, nbytes = self.axis.size, tensor.numel() * tensor.element_size()
        base = self.header + (self.calls % 2) * size * self.capacity
        starts = [base + r * self.capacity for r in range(size)]
        mine = starts[self.axis.rank]
        self.mapping[mine:mine + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        self.flags[self.axis.rank] = self.calls  # after the data: a peer that sees the flag sees the data
        self._wait(tensor)
        return [self.mapping[s:s + nbytes].view(tensor.dtype).view(tensor.shape) for s in starts]

    def _wait(self, tensor: torch.Tensor) -> None:
        spins, started = 0, time.monotonic()
        next_check = started + CHECK_EVERY_S
        while int(self.flags.min()) < self.calls:
            spins += 1
            if spins <= SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_EVERY_S
                self._check_peers(tensor, started)

    def _check_peers(self, tensor: torch.Tensor, started: float) -> None:
        """Raise the guard's error when a peer has failed or the timeout has passed (the guard's report names the
        call and, here, the ranks that never wrote it)."""
        guard = self.axis.guard
        if guard is None:
            return
        failed = guard.peer_failure()
        if failed is None and time.monotonic() - started < guard.timeout_s:
            return
        key = guard.begin(self.axis.name, "all_reduce", "host", [tensor], self.axis.ranks)
        guard.record(key).started = started
        behind = [self.axis.ranks[r] for r, f in enumerate(self.flags.tolist()) if f < self.calls]
        error = guard.fail(key, TimeoutError("shared-memory collective") if failed is None else
                           RuntimeError(f"a peer failed: {failed}"))
        cause = f"ranks {behind} never wrote shared-memory collective #{self.calls}"
        raise type(error)(f"{error} ({cause})", {**error.report, "behind": behind})

    def all_reduce(self, tensor: torch.Tensor) -> None:
        slots = self._slots(tensor)  # this rank's own is among them: `tensor` can take the sum
        tensor.copy_(slots[0])
        for slot in slots[1:]:
            tensor += slot

    def all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> None:
        for target, slot in zip(out, self._slots(tensor), strict=True):
            target.copy_(slot)


def one_host(axis: Axis) -> bool:
    """Whether every rank of `axis` runs on this host, on x86-64 (a collective: every rank of the axis calls it)."""
    here = (socket.gethostname(), platform.machine().lower() in ("x86_64", "amd64"))
    everyone = all_gather_object(here, axis, tag="host")
    return all(x86 for _, x86 in everyone) and len({host for host, _ in everyone}) == 1


@contextlib.contextmanager
def host_collectives(axis: Axis, capacity: int = CAPACITY):
    """Within: `axis`'s sum all-reduces and all-gathers of up to `capacity` bytes per rank go through a shared
    mapping when all its ranks share this host (x86-64), through the backend otherwise. A collective of the
    axis's ranks on entry (they agree and map the file, whose name is then removed: nothing is left on disk)."""
    if axis.size == 1 or axis.ranks in HOST_SLOTS or not one_host(axis):
        yield
        return
    path, mark = None, None
    if axis.rank == 0:
        handle, path = tempfile.mkstemp(prefix="paratrain_host_", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                        else None)
        os.ftruncate(handle, HostSlots.nbytes(axis.size, capacity))  # zeros: every flag at call 0
        mark = int.from_bytes(os.urandom(7), "little")
        os.pwrite(handle, mark.to_bytes(8, "little"), 0)
        os.close(handle)
    shared_path, mark = all_gather_object((path, mark), axis, tag="host")[0]
    slots = None
    try:
        mapped = False  # a host name shared by two machines or containers: the mark tells whether this is one memory
        if os.path.exists(shared_path):  # (mapping a missing file would create it)
            with contextlib.suppress(OSError, RuntimeError):
                slots = HostSlots(axis, shared_path, capacity)
                mapped = int(slots.mark) == mark
        agreed = all(all_gather_object(mapped, axis, tag="host"))  # every rank has mapped it, or gloo it is
    finally:
        if axis.rank == 0:
            os.unlink(shared_path)  # the mappings stay; nothing is left on disk
    if not agreed:
        yield
        return
    HOST_SLOTS[axis.ranks] = slots
    try:
        yield
    finally:
        HOST_SLOTS.pop(axis.ranks, None)
