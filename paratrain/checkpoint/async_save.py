"""Asynchronous saves: training stalls only while the state is copied to host memory; a thread writes the copy.

[Note: what an asynchronous save is]
`stage_save` (save.py) runs at the call, on the training thread and on this rank alone (no collective): what
training changes (the optimizer's options and scalars, the states' JSON, digests of model-parallel copies) and a host
copy of every tensor this rank writes, through the engine's `SavePlan` (what does not change, worked out once). That
is the stall. Then the writing thread (one, started with the engine) does what a synchronous save does after staging
(`write_staged`: the one gather that checks every rank's tag, input and pieces, the rank files, the gather of what
each rank wrote, rank 0's manifest, the rename of `<tag>.partial`, then `latest`), so the format is the same and a
save that dies half way leaves only a `.partial` directory, which nothing loads.

The thread's collectives run on a process group of their own (gloo, every rank), never on the training groups: two
threads sharing one group could interleave their collectives differently on different ranks, and torch's own
`dcp.async_save` on the training group deadlocks for that reason. One save is in flight at a time: the next save,
a load, the end of the job and `engine.destroy` wait for it first, and raise its error if it failed (on every
rank: `write_staged` agrees on failures over its group).

The cost: a second copy of this rank's share of the checkpoint (`staged_bytes`) until it is written, and the
writing thread's CPU time beside training.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

from paratrain.checkpoint.format import CheckpointError
from paratrain.checkpoint.save import StagedSave, write_staged
from paratrain.layout.mesh import Axis, Mesh


def writer_axis(mesh: Mesh, timeout_s: float) -> Axis:
    """The asynchronous writes' own group over every rank (collective: every rank calls it, at the same point).
    The mesh owns it, so that `mesh.destroy()` frees it."""
    import torch.distributed as dist

    ranks = tuple(range(mesh.world_size))
    group = None
    if len(ranks) > 1:
        group = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timedelta(seconds=timeout_s))
        mesh.owned_groups.append(group)
    return Axis("checkpoint", ranks, mesh.rank, group)


class CheckpointWriter:
    """Writes staged saves on a thread of its own, one at a time; `wait` blocks until the one in flight is written
    and raises its error.

    The thread is started once, here, and waits for work: starting a thread at each save made the call wait until
    the new thread had run (Python's `Thread.start` waits for it to begin, and it then holds the interpreter lock
    for up to a switch interval, 5 ms), which was most of a small model's stall."""

    def __init__(self, axis: Axis):
        self.axis = axis
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paratrain-checkpoint-writer")
        self._pool.submit(lambda: None).result()  # the thread starts now, not at the first save
        self._pending: Future | None = None
        self._tag = ""

    def submit(self, staged: StagedSave, record: dict) -> None:
        """Write `staged` on the thread; its seconds (the rank files to `latest`) go to record["write_s"] when done."""
        self.wait()
        self._tag = staged.tag
        self._pending = self._pool.submit(self._write, staged, record)

    def _write(self, staged: StagedSave, record: dict) -> None:
        start = time.perf_counter()
        try:
            write_staged(staged, self.axis)
        finally:
            staged.tensors.clear()  # the host copy goes as soon as it is written
            record["write_s"] = time.perf_counter() - start

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise its error (collective in effect: every rank's
        thread ends the same way)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = pending.exception()
        if error is not None:
            raise CheckpointError(f"the asynchronous save of checkpoint '{self._tag}' failed: {error}") from error

    def close(self) -> None:
        """Wait for the save in flight, then end the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
