"""A layout: one way of running the model on N devices (mesh sizes, ZeRO stage, schedule, batch split, ...).

The mesh naming mirrors `paratrain.layout.mesh.build_mesh` exactly, because predicted communication is compared
with `engine.comm_stats()`, which is keyed by those names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np

from paratrain.config.parallel import SCHEDULES, V_SCHEDULES
from paratrain.layout.dims import ParallelDims
from paratrain.parallel.pp.schedules import partial_backwards

Precision = Literal["fp32", "bf16", "fp16"]
Schedule = Literal[("none", *SCHEDULES)]  # type: ignore[valid-type] (no pipeline, or a schedule's name)
Recompute = Literal["none", "selective", "full"]
CpMethod = Literal["ring", "ulysses", "usp"]
Optimizer = Literal["adamw", "muon"]

CP_METHODS: tuple[str, ...] = ("ring", "ulysses", "usp")
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")


@functools.lru_cache(maxsize=4096)
def mesh_dims(world: int, dp: int, pp: int, cp: int, tp: int, ep: int, cp_ulysses: int, dp_replicate: int
              ) -> ParallelDims:
    """One `ParallelDims` per mesh, shared by every layout on it (with the groups and names it has worked out)."""
    return ParallelDims(world, dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, cp_ulysses=cp_ulysses, dp_replicate=dp_replicate)


@functools.lru_cache(maxsize=65536)
def axis_name(dims: ParallelDims, axes: tuple[str, ...]) -> str | None:
    """`dims.axis_name(axes)`, once per mesh and axes, and for one dim with numpy (`dims.axis_name` walks the
    members rank by rank: slow on a big mesh): the first named dim with the same members as rank 0's group."""
    key = dims.canonical(axes)
    if len(key) > 1:
        return dims.axis_name(axes)
    size = dims.size(key)
    if size == 1:
        return None
    if key == ("world",):
        return "world"
    members = first_group(dims, key[0])
    for name, d in dims.dims.items():
        if name != "world" and d.size == size and np.array_equal(first_group(dims, name), members):
            return name
    return "_".join(key)


@functools.lru_cache(maxsize=65536)
def first_group(dims: ParallelDims, name: str) -> np.ndarray:
    """Rank 0's group along the dim `name`, in order: its grid index over the dim's grid dims steps by the stride
    (every other grid coordinate 0)."""
    d = dims.dims[name]
    index = np.arange(d.size) * d.stride
    rank, place = np.zeros(d.size, dtype=np.int64), 1
    for g, size in reversed(dims.grid):  # inner to outer
        if g in d.grid:
            index, digit = np.divmod(index, size)
            rank += digit * place
        place *= size
    return rank


@dataclass(frozen=True)
class Layout:
    dp: int
    micro_batch: int
    grad_accum: int  # micro-batches per optimizer step per rank (= pipeline micro-batches when pp > 1)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    schedule: Schedule = "none"
    virtual_stages: int = 1
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    precision: Precision = "bf16"
    cp_method: CpMethod = "ring"
    ulysses_size: int = 1  # usp: the all-to-all degree inside cp (ring attention runs over cp / ulysses_size)
    ep: int = 1  # expert parallelism, folded inside dp x cp (`paratrain.layout.dims`: ep and edp split dp_shard_cp)
    optimizer: Optimizer = "adamw"  # "muon": Muon on the blocks' matrices, AdamW on the rest (`paratrain.muon`)
    dp_replicate: int = 1  # HSDP: ZeRO shards over dp x cp / dp_replicate ranks and replicates across them

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def sizes(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}

    @functools.cached_property
    def dims(self) -> ParallelDims:
        """The mesh's named dims, as the engine builds them from this layout's config (the names comm stats
        are keyed by)."""
        return mesh_dims(self.world, self.dp, self.pp, self.cp, self.tp, self.ep,
                         self.ulysses_size if self.cp_method == "usp" else 1, self.dp_replicate)

    @property
    def head_rank(self) -> int:
        """The pipeline rank that holds the head (the loss): the last, or rank 0 under a V schedule, whose
        rank 0 holds the first stage and the last (stage 2p - 1)."""
        return 0 if self.schedule in V_SCHEDULES else self.pp - 1

    def stages_held(self, rank: int) -> list[int]:
        """The pipeline stages (chunks) a pp rank holds: rank, rank + p, ... (loop) or rank, 2p - 1 - rank (V)."""
        if self.schedule in V_SCHEDULES:
            return [rank, 2 * self.pp - 1 - rank]
        return [rank + j * self.pp for j in range(self.virtual_stages)]

    @property
    def partial_backwards(self) -> bool:
        """One pipeline backward reaches only part of a rank's parameters (two chunks per rank, or B apart from
        W): ZeRO-2 then reduce-scatters once per step, at each parameter's last gradient."""
        return partial_backwards(self.schedule, self.pp, self.virtual_stages)

    @property
    def ulysses_degree(self) -> int:
        """Ranks an all-to-all spans in each attention (1: ring attention only)."""
        return {"ring": 1, "ulysses": self.cp, "usp": self.ulysses_size}[self.cp_method] if self.cp > 1 else 1

    @property
    def ring_degree(self) -> int:
        """Ranks ring attention passes K and V around (1: Ulysses only)."""
        return self.cp // self.ulysses_degree

    @property
    def shard_group(self) -> int:
        """Ranks ZeRO shards over: dp x cp (cp ranks see other tokens), over dp_replicate replicas under HSDP."""
        return self.dp * self.cp // self.dp_replicate

    @property
    def expert_shard_group(self) -> int:
        """The expert-data-parallel group (edp): ranks of a shard group holding the same experts. Expert
        gradients are reduced over it (and the replicas) and ZeRO shards expert states over it."""
        return self.shard_group // self.ep

    # ---- byte sizes -------------------------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        """Bytes of one model parameter (and of one gradient element) as the forward/backward sees it."""
        return 4 if self.precision == "fp32" else 2

    @property
    def activation_bytes(self) -> int:
        return self.param_bytes

    def describe(self) -> str:
        mesh = " ".join(f"{a}{size}" for a, size in self.sizes.items())
        mesh += f" ep{self.ep}" if self.ep > 1 else ""
        mesh += f" replicate{self.dp_replicate}" if self.dp_replicate > 1 else ""
        parts = [mesh, f"zero{self.zero_stage}" + ("+offload" if self.offload_optimizer else "")]
        if self.pp > 1:
            parts.append(self.schedule + (f"(v{self.virtual_stages})" if self.virtual_stages > 1 else ""))
        parts.append(f"mb{self.micro_batch}x{self.grad_accum}")
        if self.cp > 1 and self.cp_method != "ring":
            parts.append(self.cp_method + (f"(u{self.ulysses_size})" if self.cp_method == "usp" else ""))
        if self.sequence_parallel:
            parts.append("sp")
        if self.recompute != "none":
            parts.append(f"ckpt:{self.recompute}")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        return " ".join(parts)

