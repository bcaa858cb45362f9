"""Communication on named mesh axes, every call counted (see `CommStats`).

As `deepspeed.comm` it also answers DeepSpeed's rank queries (get_rank, get_world_size, get_local_rank,
is_initialized); its collectives take a mesh Axis, and DeepSpeed's group-based ones raise an error that says
to use torch.distributed (docs/deepspeed-compat.md).
"""

import os

from torch.distributed import get_rank, get_world_size, is_initialized

from paratrain.comm.autograd import (
    copy_to_region,
    exchange_rows,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
)
from paratrain.comm.collectives import (
    Handle,
    all_gather_into,
    all_gather_list,
    all_gather_object,
    all_reduce,
    all_to_all_into,
    all_to_all_rows,
    barrier,
    broadcast,
    reduce_scatter_into,
    send_recv,
)
from paratrain.comm.groups import build_mesh
from paratrain.comm.guard import CollectiveTimeout, CommGuard, PeerFailed
from paratrain.comm.stats import CommStats, OpCount

__all__ = [
    "CollectiveTimeout",
    "PeerFailed",
    "CommGuard",
    "CommStats",
    "Handle",
    "OpCount",
    "all_gather_into",
    "all_gather_list",
    "all_gather_object",
    "all_reduce",
    "all_to_all_into",
    "all_to_all_rows",
    "barrier",
    "broadcast",
    "build_mesh",
    "copy_to_region",
    "exchange_rows",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "gather_from_region",
    "gather_from_sequence",
    "is_initialized",
    "reduce_from_region",
    "reduce_scatter_into",
    "reduce_scatter_to_sequence",
    "scatter_to_region",
    "send_recv",
]


def get_local_rank() -> int:
    """This process's index on its node (torchrun's LOCAL_RANK), as deepspeed.comm.get_local_rank."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def __getattr__(name: str):
    """deepspeed.comm.<name> that paratrain.comm does not provide: an error naming it and the replacement."""
    from paratrain.compat.names import COMM, refuse

    refuse(COMM, "paratrain.comm (deepspeed.comm)", name)
