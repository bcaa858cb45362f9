"""The machine the plan is for, and how long a collective takes on it (alpha-beta model, ring algorithms).

Defaults describe an H100/H200 SXM node: 989 TFLOP/s dense bf16, NVLink inside a node of 8, InfiniBand
between nodes. Bandwidths are *achieved bus bandwidths* per GPU (what nccl-tests reports as busbw), so the
ring formulas below turn a payload into time without further efficiency factors.

[Note: ring factors]
For a group of n ranks and a payload of B bytes (paratrain.comm's payload: the full tensor of an all-reduce,
the gathered output of an all-gather, the unreduced input of a reduce-scatter), a ring moves per rank
  all-reduce       2 (n-1)/n * B   in 2 (n-1) steps
  all-gather       (n-1)/n * B     in   (n-1) steps
  reduce-scatter   (n-1)/n * B     in   (n-1) steps
  send / recv      B               in 1 step
so time = steps * latency + moved / bandwidth (Thakur, Rabenseifner & Gropp 2005; Chan et al. 2007).

[Note: measured costs per collective]
On a CPU with gloo the ring model misses what dominates small collectives: each call's host work (Python,
the autograd function around it, the buffers) and each op's own implementation (gloo's all-gather and
reduce-scatter are slower per byte than its all-reduce). `op_costs` holds, per op, (seconds per call, payload
bytes per second) measured through `paratrain.comm` on groups of `op_costs_group` ranks (benchmarks/
planner_ranking.py calibrates them); a collective on a group of that size is then `calls * a + payload / b`.
Other group sizes, and ops not measured, keep the ring model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from paratrain.errors import InvalidValueError
from paratrain.layout.dims import ParallelDims

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    gpu_memory: float = 80 * GiB
    """Bytes of device memory per GPU."""
    gpus_per_node: int = 8
    intra_node_bandwidth: float = 300e9
    """Achieved bus bandwidth per GPU inside a node, bytes/s (NVLink 4: ~360-450 GB/s busbw)."""
    inter_node_bandwidth: float = 40e9
    """Achieved bus bandwidth per GPU between nodes, bytes/s (one 400 Gb/s NIC per GPU: ~40-45 GB/s)."""
    latency: float = 10e-6
    """Seconds per ring step (alpha)."""
    peak_flops: float = 989e12
    """Dense peak of the training precision, FLOP/s per GPU (H100/H200 SXM bf16)."""
    mfu: float = 0.5
    """Fraction of peak the forward/backward kernels reach (model FLOPs utilization of the compute alone)."""
    micro_batch_overhead: float = 0.0
    """Fixed seconds per micro-batch forward+backward (launch/framework overhead; calibrated on CPU)."""
    overlap: float = 1.0
    """Fraction of an overlappable compute window communication can use (streams on a GPU; on a CPU gloo's
    threads compete with the compute for the same cores)."""
    memory_bandwidth: float = 3.35e12
    """Device memory bandwidth, bytes/s: the optimizer step is memory-bound."""
    pcie_bandwidth: float = 25e9
    """Host-device bandwidth, bytes/s (optimizer offload moves gradients down and parameters up)."""
    host_memory_bandwidth: float = 100e9
    """Host memory bandwidth, bytes/s (an offloaded optimizer step runs on the CPU)."""
    memory_headroom: float = 0.1
    """Fraction of device memory kept free for the CUDA context, workspaces and fragmentation."""
    shared_host_slowdown: float = 1.0
    """How much slower a process computes while the other processes of its node compute too (CPU processes
    share caches and memory bandwidth; 1 for GPUs): applied to the compute of layouts with more than one
    rank per node."""
    op_costs: tuple[tuple[str, float, float], ...] = ()
    """Measured (op, seconds per call, payload bytes/s) on groups of `op_costs_group` ranks (see the note)."""
    op_costs_group: int = 2

    @property
    def usable_memory(self) -> float:
        return self.gpu_memory * (1.0 - self.memory_headroom)


RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
              "reduce_scatter": lambda n: n - 1, "send": lambda n: 1, "recv": lambda n: 0,
              "broadcast": lambda n: n - 1, "all_to_all": lambda n: n - 1}
RING_MOVED = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "send": lambda n: 1.0, "recv": lambda n: 0.0,
              "broadcast": lambda n: 1.0, "all_to_all": lambda n: 1.0}  # its payload: what leaves the rank


def measured_seconds(hw: Hardware, op: str, payload_bytes: float, group_size: int, calls: int) -> float | None:
    """`calls` collectives of `op` moving `payload_bytes` from `hw.op_costs`, or None if not measured for it."""
    if group_size != hw.op_costs_group:
        return None
    for name, per_call, bytes_per_s in hw.op_costs:
        if name == op:
            return calls * per_call + payload_bytes / bytes_per_s
    return None


def collective_seconds(op: str, payload_bytes: float, group_size: int, bandwidth: float, latency: float,
                       calls: int = 1) -> float:
    """Time of `calls` collectives of `op` moving `payload_bytes` in total over a ring of `group_size`.

    A recv costs nothing on its own: the matching send on the peer carries the time.
    """
    if group_size <= 1 or payload_bytes == 0:
        return 0.0
    if op not in RING_STEPS:
        raise InvalidValueError(f"no ring model for collective {op!r}; known: {sorted(RING_STEPS)}")
    return calls * RING_STEPS[op](group_size) * latency + RING_MOVED[op](group_size) * payload_bytes / bandwidth


@functools.lru_cache(maxsize=65536)  # a search asks each of a few thousand meshes about each of its axes
def spans_nodes(dims: ParallelDims, axes: tuple[str, ...], gpus_per_node: int) -> bool:
    """True when some group along `axes` (named dims) contains ranks of two different nodes (ranks fill nodes
    in order). One dim: with numpy, every rank at once (`spans_nodes_by_groups` walks the groups one by one, slow on
    a big mesh's split dims): a group is the ranks that agree on every grid coordinate outside the dim and on the
    dim's grid index but its digit, (index // stride) % size."""
    key = dims.canonical(axes)
    if len(key) > 1:
        return spans_nodes_by_groups(dims, axes, gpus_per_node)
    d = dims.dim(key[0])
    coords = dict(zip((g for g, _ in dims.grid), np.indices([s for _, s in dims.grid]).reshape(len(dims.grid), -1)))
    index = np.zeros(dims.world_size, dtype=np.int64)
    for g in d.grid:
        index = index * dims.dims[g].size + coords[g]
    group = index - (index // d.stride) % d.size * d.stride
    for g, size in dims.grid:  # np.indices enumerates ranks in order (the grid, outer to inner)
        if g not in d.grid:
            group = group * size + coords[g]
    nodes = np.arange(dims.world_size) // gpus_per_node
    return len(np.unique(group * (nodes[-1] + 1) + nodes)) > len(np.unique(group))


def spans_nodes_by_groups(dims: ParallelDims, axes: tuple[str, ...], gpus_per_node: int) -> bool:
    return any(min(g) // gpus_per_node != max(g) // gpus_per_node for g in dims.groups(axes))


def axis_bandwidth(hw: Hardware, dims: ParallelDims, axes: tuple[str, ...]) -> float:
    """The bandwidth a group along `axes` runs at: NVLink if every group stays in a node, else the network."""
    return hw.inter_node_bandwidth if spans_nodes(dims, axes, hw.gpus_per_node) else hw.intra_node_bandwidth
