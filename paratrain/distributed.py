"""Process-group start-up: torchrun's environment, or a one-process world when there is none."""

from __future__ import annotations

import atexit
import datetime
import os
import sys

import torch
import torch.distributed as dist

from paratrain.comm.guard import CollectiveTimeout


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(dist_backend: str | None = None, timeout: datetime.timedelta | float | None = None,
                     **_ignored) -> None:
    """Initialize torch.distributed once (DeepSpeed's `init_distributed`).

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) it joins that world. Without them it starts a world
    of one process on an in-memory store, so scripts and the single-process reference run unchanged.
    Extra DeepSpeed keyword arguments (auto_mpi_discovery, verbose, ...) are accepted and ignored.
    """
    if dist.is_initialized():
        return
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    backend = dist_backend or default_backend()
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, **kwargs)
    else:
        store = dist.HashStore()
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, **kwargs)
    # Scripts rarely tear the group down; without this, gloo's threads can abort the interpreter at exit
    # ("terminate called without an active exception") and torchrun reports a failed job.
    atexit.register(_destroy_at_exit)
    sys.excepthook = _exit_on_collective_timeout(sys.excepthook)


def _exit_on_collective_timeout(previous):
    """After an uncaught CollectiveTimeout, end the process right after the traceback.

    [Note: why not a normal exit] The backend still holds the collective that never completed, and
    destroying the process group (at exit) blocks until every peer has left — the hang the guard just
    reported. The report is written and the traceback printed; nothing else is worth waiting for.
    """

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        if isinstance(value, CollectiveTimeout):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    return hook


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def current_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
