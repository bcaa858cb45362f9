"""Process-group start-up: torchrun's environment, or a one-process world when there is none."""

from __future__ import annotations

import atexit
import datetime
import os
import sys

import torch
import torch.distributed as dist

from paratrain.comm.guard import CollectiveTimeout
from paratrain.errors import RunError
from paratrain.failure import install_excepthook


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | float | None = None,
                     init_method: str | None = None, dist_init_required: bool | None = None, config=None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialize torch.distributed once (DeepSpeed's `init_distributed`, same arguments).

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) it joins that world; `init_method` with `rank` and
    `world_size` joins an explicit one. Without either it starts a world of one process on an in-memory
    store, so scripts and the single-process reference run unchanged. `verbose`, `config` (DeepSpeed's comms
    logger) and `dist_init_required` change nothing here; `distributed_port` only serves DeepSpeed's MPI
    discovery, which paratrain does not do: a job started by mpirun without torchrun's variables is refused
    rather than silently split into one-process worlds. Under torchrun an uncaught error is then reported once
    for the whole job (`paratrain.failure`).
    """
    install_excepthook()
    if dist.is_initialized():
        return
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    backend = dist_backend or default_backend()
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
        # NCCL moves only CUDA tensors; the few host tensors a job reduces (offloaded optimizer shards,
        # checkpoint manifests, host-side metrics) go over gloo in the same groups instead of failing.
        backend = "cpu:gloo,cuda:nccl"
    if init_method is not None or rank >= 0:
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size, **kwargs)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, **kwargs)
    elif auto_mpi_discovery and any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        raise RunError("this process was started by MPI, but paratrain does not discover ranks from MPI "
                       "(DeepSpeed's auto_mpi_discovery); launch with `paratrain run` or torchrun, or pass "
                       "init_method=, rank= and world_size= to init_distributed")
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


def uses_cuda() -> bool:
    """Whether the initialized world reduces CUDA tensors (NCCL, alone or beside gloo for host tensors)."""
    return dist.is_initialized() and "nccl" in dist.get_backend()


def current_device() -> torch.device:
    if uses_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
