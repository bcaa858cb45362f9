"""Communication on named mesh axes, every call counted (see `CommStats`)."""

from paratrain.comm.autograd import (
    copy_to_region,
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
    barrier,
    broadcast,
    reduce_scatter_into,
    send_recv,
)
from paratrain.comm.guard import CollectiveTimeout, CommGuard
from paratrain.comm.stats import CommStats, OpCount

__all__ = [
    "CollectiveTimeout",
    "CommGuard",
    "CommStats",
    "Handle",
    "OpCount",
    "all_gather_into",
    "all_gather_list",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "copy_to_region",
    "gather_from_region",
    "gather_from_sequence",
    "reduce_from_region",
    "reduce_scatter_into",
    "reduce_scatter_to_sequence",
    "scatter_to_region",
    "send_recv",
]
