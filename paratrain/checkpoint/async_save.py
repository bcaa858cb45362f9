"""Asynchronous saves: training stalls only while the state is copied to host memory; a thread writes the copy.

[Note: what an asynchronous save is]
`stage_save` (save.py) runs at the call, on the training thread and on this rank alone (no collective): the piece
table, the optimizer's options and scalars, the states' JSON, and a host copy of every tensor this rank writes. That
is the stall. Then a thread does what a synchronous save does after staging (`write_staged`: the one gather that
checks every rank's tag, input and pieces, the rank files, the gather of what each rank wrote, rank 0's manifest,
the rename of `<tag>.partial`, then `latest`), so the format is the same and a save that dies half way leaves only a
`.partial` directory, which nothing loads.

The thread's collectives run on a process group of their own (gloo, every rank), never on the training groups: two
threads sharing one group could interleave their collectives differently on different ranks, and torch's own
`dcp.async_save` on the training group deadlocks for that reason. One save is in flight at a time: the next save,
a load, the end of the job and `engine.destroy` wait for it first, and raise its error if it failed (on every
rank: `write_staged` agrees on failures over its group).

The cost: a second copy of this rank's share of the checkpoint (`staged_bytes`) until it is written, and the
writing thread's CPU time beside training.
"""

from __future__ import annotations

import threading
import time
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
    """Writes staged saves on a thread, one at a time; `wait` joins the one in flight and raises its error."""

    def __init__(self, axis: Axis):
        self.axis = axis
        self._thread: threading.Thread | None = None
        self._tag = ""
        self._error: BaseException | None = None

    def submit(self, staged: StagedSave, record: dict) -> None:
        """Write `staged` on a thread; its seconds (the rank files to `latest`) go to record["write_s"] when done."""
        self.wait()
        self._tag, self._error = staged.tag, None
        self._thread = threading.Thread(target=self._write, args=(staged, record), name="paratrain-checkpoint-writer")
        self._thread.start()

    def _write(self, staged: StagedSave, record: dict) -> None:
        start = time.perf_counter()
        try:
            write_staged(staged, self.axis)
        except BaseException as exc:  # handed to the training thread by `wait`
            self._error = exc
        finally:
            staged.tensors.clear()  # the host copy goes as soon as it is written
            record["write_s"] = time.perf_counter() - start

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise its error (collective in effect: every rank's
        thread ends the same way)."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"the asynchronous save of checkpoint '{self._tag}' failed: {error}") from error
