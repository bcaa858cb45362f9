"""The mesh's named dims: pure rank math (no torch.distributed), so every layout can be checked in one process.

Ranks are laid out on a grid of five dims, outer to inner:

    dp_replicate  dp_shard  pp  cp  tp

`tp` is innermost so that a tensor-parallel group is a run of consecutive ranks (one node's fast links);
`dp_replicate` is outermost because its traffic (one all-reduce of each gradient shard per step) tolerates slow
links best. Every other dim is derived from the grid, either as a flattening of grid dims or as one of the two
factors of a dim split in two (the split's inner factor is a run of consecutive members):

    dp           dp_replicate x dp_shard   ranks that draw different samples
    dp_cp        dp x cp                   ranks whose gradients are averaged (they saw different tokens)
    dp_shard_cp  dp_shard x cp             ranks over which ZeRO shards (replicated over dp_replicate)
    edp, ep      dp_shard_cp split         experts split over ep, sharded over edp (Megatron's folding)
    cp_ring, cp_ulysses   cp split         USP: Ulysses inside, ring across
    world        every grid dim

A group along some dims is the set of ranks that differ only in those dims' coordinates; dims may be combined
when they are independent (`groups(("pp", "tp"))`), ordered outer to inner by how far apart consecutive members
are. Adding a dim is adding one entry to `_derived` (see docs/architecture.md, "How to add a dim").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from paratrain.errors import Error


class MeshError(Error, ValueError):
    """A layout that cannot be built; the message names the sizes and the fix."""


@dataclass(frozen=True)
class Dim:
    """A named dim: the coordinate of a rank is `(index // stride) % size`, where `index` is the rank's
    position in the flattening of `grid` (grid dims, outer to inner)."""

    name: str
    grid: tuple[str, ...]
    size: int
    stride: int = 1
    parent: str = ""  # the dim this one is a factor of (split in two), if any


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the grid dims. `dp=-1`: whatever is left of the world; `dp_replicate` of the dp ranks
    replicate (HSDP), the rest (`dp_shard`) shard."""

    world_size: int
    dp: int = -1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    cp_ulysses: int = 1  # USP: ranks of a cp group that share a ring rank's tokens (Ulysses inside, ring across)
    ep: int = 1  # expert parallelism, folded inside dp_shard x cp
    dp_replicate: int = 1  # HSDP: data-parallel ranks that hold the same shards (dp = dp_replicate x dp_shard)
    dims: dict[str, Dim] = field(init=False, repr=False, compare=False)
    _sizes: dict = field(init=False, repr=False, compare=False)  # `size` per names asked (the norm asks each step)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise MeshError(f"world_size must be >= 1, got {self.world_size}")
        for name in ("pp", "cp", "tp", "dp_replicate"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MeshError(f"{name} size must be a positive integer, got {value!r}")
        model_parallel = self.pp * self.cp * self.tp
        if self.dp == -1:
            if self.world_size % model_parallel:
                raise MeshError(f"pp*cp*tp = {self.pp}*{self.cp}*{self.tp} = {model_parallel} does not divide the "
                                f"world size {self.world_size}; choose sizes whose product divides {self.world_size}")
            object.__setattr__(self, "dp", self.world_size // model_parallel)
        elif not isinstance(self.dp, int) or self.dp < 1:
            raise MeshError(f"dp size must be a positive integer or -1 (the rest), got {self.dp!r}")
        if self.dp * model_parallel != self.world_size:
            raise MeshError(f"dp*pp*cp*tp = {self.dp}*{self.pp}*{self.cp}*{self.tp} = {self.dp * model_parallel}, "
                            f"but the world size is {self.world_size}; set dp=-1 to use the rest, or change the "
                            f"sizes so the product is {self.world_size}")
        if self.dp % self.dp_replicate:
            raise MeshError(f"data_parallel.replicate {self.dp_replicate} must divide the data-parallel size "
                            f"{self.dp} (dp = replicate x shard); use one of {_divisors(self.dp)}")
        if not isinstance(self.cp_ulysses, int) or self.cp_ulysses < 1 or self.cp % self.cp_ulysses:
            raise MeshError(f"the Ulysses size {self.cp_ulysses!r} must be a positive divisor of cp ({self.cp})")
        folded = self.dp_shard * self.cp
        if not isinstance(self.ep, int) or self.ep < 1 or folded % self.ep:
            dp = "dp" if self.dp_replicate == 1 else "dp / data_parallel.replicate"
            raise MeshError(f"expert_parallel.size {self.ep!r} (deepspeed.moe.layer.MoE's ep_size sets it) must "
                            f"divide {dp} x cp = {self.dp_shard}x{self.cp} = {folded} (the experts are split "
                            f"over ranks that see different tokens and hold different shards); use one of "
                            f"{_divisors(folded)}")
        object.__setattr__(self, "dims", self._named())
        object.__setattr__(self, "_sizes", {})

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def grid(self) -> tuple[tuple[str, int], ...]:
        """The grid dims and their sizes, outer to inner."""
        return (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("pp", self.pp), ("cp", self.cp),
                ("tp", self.tp))

    def _named(self) -> dict[str, Dim]:
        """Every named dim. The order is the order of preference when two dims are the same group (with no
        replication, dp is dp_shard; its traffic is counted as dp's)."""
        sizes = dict(self.grid)
        out: dict[str, Dim] = {}

        def flat(name: str, *grid: str) -> None:
            out[name] = Dim(name, grid, math.prod(sizes[g] for g in grid))

        def split(parent: str, outer: str, inner: str, inner_size: int) -> None:
            p = out[parent]
            out[outer] = Dim(outer, p.grid, p.size // inner_size, inner_size, parent)
            out[inner] = Dim(inner, p.grid, inner_size, 1, parent)

        flat("dp", "dp_replicate", "dp_shard")
        for name in ("pp", "cp", "tp", "dp_replicate", "dp_shard"):
            flat(name, name)
        flat("dp_cp", "dp_replicate", "dp_shard", "cp")
        flat("dp_shard_cp", "dp_shard", "cp")
        split("dp_shard_cp", "edp", "ep", self.ep)
        split("cp", "cp_ring", "cp_ulysses", self.cp_ulysses)
        flat("world", *sizes)
        return out

    def layout(self) -> dict[str, int]:
        """The sizes that define this layout (what a checkpoint records, and compares to know it is loaded
        into the same layout)."""
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp, "dp_replicate": self.dp_replicate,
                "ep": self.ep, "cp_ulysses": self.cp_ulysses}

    # ---- what "data-parallel" counts ------------------------------------------------------------------
    @property
    def sample_parallel_size(self) -> int:
        """Ranks that draw different samples: dp. The batch arithmetic counts these (global batch = micro-batch
        x accumulation steps x dp): context-parallel ranks hold other tokens of the same samples, and pipeline
        and tensor-parallel ranks the same tokens. DeepSpeed's `dp_world_size` (without sequence parallelism)."""
        return self.dp

    @property
    def gradient_average_size(self) -> int:
        """Ranks whose gradients are averaged: dp x cp, because context-parallel ranks computed their
        gradients from different tokens. DeepSpeed's `seq_dp_world_size`."""
        return self.dp * self.cp

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks holding the same experts: dp x cp / ep."""
        return self.dp * self.cp // self.ep

    # ---- pure rank math -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.grid)

    def dim(self, name: str) -> Dim:
        if name not in self.dims:
            raise MeshError(f"unknown mesh dim {name!r}; the dims are {', '.join(self.dims)}")
        return self.dims[name]

    def canonical(self, names: str | Sequence[str]) -> tuple[str, ...]:
        """`names` as one key, outer to inner (the dim whose consecutive members are farthest apart first), so
        ("cp", "dp") and ("dp", "cp") are the same group."""
        names = (names,) if isinstance(names, str) else tuple(dict.fromkeys(names))
        order = {n: i for i, n in enumerate(self.dims)}
        return tuple(sorted(names, key=lambda n: (-self._step(self.dim(n)), order[n])))

    def size(self, names: str | Sequence[str]) -> int:
        """The size of the group along `names` (dims that lie inside one another are refused: "overlap")."""
        asked = names if isinstance(names, str) else tuple(names)
        if asked not in self._sizes:
            key = self.canonical(asked)
            if len(key) > 1:
                self._members(0, key)  # raises for overlapping dims
            self._sizes[asked] = math.prod(self.dim(n).size for n in key)
        return self._sizes[asked]

    def grid_coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the world of size {self.world_size}")
        out: dict[str, int] = {}
        for name, size in reversed(self.grid):
            out[name], rank = rank % size, rank // size
        return {name: out[name] for name, _ in self.grid}

    def rank_at(self, coords: dict[str, int]) -> int:
        """The rank at these grid coordinates (missing ones: 0)."""
        rank = 0
        for name, size in self.grid:
            c = coords.get(name, 0)
            if not 0 <= c < size:
                raise MeshError(f"coordinate {name}={c} is outside the dim of size {size}")
            rank = rank * size + c
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate on every named dim but the world (e.g. {"dp": 1, "pp": 0, ..., "ep": 0})."""
        grid = self.grid_coords(rank)
        return {name: self._coord(grid, d) for name, d in self.dims.items() if name != "world"}

    def groups(self, names: str | Sequence[str]) -> list[list[int]]:
        """Every group along `names`: ranks that differ only in those dims' coordinates, in a fixed order
        (members in the order of the combined coordinate, outer dim first)."""
        key = self.canonical(names)
        first = self._members(0, key)
        if all(self._whole(self.dims[n]) for n in key):  # whole grid dims: every group a translate of rank 0's
            spanned = {g for n in key for g in self.dims[n].grid}
            others = [(g, size) for g, size in self.grid if g not in spanned]
            bases = [self.rank_at(dict(zip([g for g, _ in others], c)))
                     for c in itertools.product(*(range(size) for _, size in others))]
            return [[base + m for m in first] for base in bases]
        seen: set[int] = set()
        out = []
        for rank in range(self.world_size):
            if rank not in seen:
                members = self._members(rank, key)
                seen.update(members)
                out.append(members)
        return out

    def group_of(self, rank: int, names: str | Sequence[str]) -> list[int]:
        """The members of the group along `names` that contains `rank`."""
        return self._members(rank, self.canonical(names))

    def axis_name(self, names: str | Sequence[str]) -> str | None:
        """The name `paratrain.comm.build_mesh` gives the group along `names`: the first named dim with the same
        members (("dp", "cp") is "dp_cp", or "dp" when cp is 1), "world" for the world itself, the names joined
        for a combination of its own; None when the group is one rank (collectives on it are skipped)."""
        key = self.canonical(names)
        size = self.size(key)  # the number of members (refusing overlapping dims)
        if size == 1:
            return None
        if key == ("world",):
            return "world"
        members = self._members(0, key)
        for name, d in self.dims.items():  # only a dim of as many members can have the same ones
            if name != "world" and d.size == size and self._members(0, (name,)) == members:
                return name
        return "_".join(key)

    def describe(self) -> str:
        parts = [f"{n}{s}" for n, s in (("dp", self.dp), ("pp", self.pp), ("cp", self.cp), ("tp", self.tp)) if s > 1]
        described = " x ".join(parts) or "single process"
        if self.dp_replicate > 1:
            described += f" (dp: replicate {self.dp_replicate} x shard {self.dp_shard})"
        fold = "dp_shard x cp" if self.dp_replicate > 1 else "dp x cp"
        return described + (f" (ep{self.ep} folded in {fold})" if self.ep > 1 else "")

    # ---- digits -----------------------------------------------------------------------------------------
    def _coord(self, grid: dict[str, int], d: Dim) -> int:
        index = 0
        for g in d.grid:
            index = index * self.dims[g].size + grid[g]
        return (index // d.stride) % d.size

    def _with_coord(self, grid: dict[str, int], d: Dim, value: int) -> dict[str, int]:
        """`grid` with `d`'s coordinate set to `value` (the other digits of its grid dims kept)."""
        index = 0
        for g in d.grid:
            index = index * self.dims[g].size + grid[g]
        index += (value - (index // d.stride) % d.size) * d.stride
        out = dict(grid)
        for g in reversed(d.grid):
            out[g], index = index % self.dims[g].size, index // self.dims[g].size
        return out

    def _whole(self, d: Dim) -> bool:
        """`d` is a whole flattening of its grid dims (no split)."""
        return d.stride == 1 and d.size == math.prod(self.dims[g].size for g in d.grid)

    def _step(self, d: Dim) -> int:
        """How far apart two members of a group along `d` with consecutive coordinates are (0: size 1)."""
        return self.rank_at(self._with_coord(self.grid_coords(0), d, 1)) if d.size > 1 else 0

    def _members(self, rank: int, key: tuple[str, ...]) -> list[int]:
        grid, dims = self.grid_coords(rank), [self.dims[n] for n in key]
        members = []
        for values in itertools.product(*(range(d.size) for d in dims)):
            moved = grid
            for d, v in zip(dims, values):
                moved = self._with_coord(moved, d, v)
            members.append(self.rank_at(moved))
        if len(set(members)) != len(members):
            raise MeshError(f"dims {', '.join(key)} overlap (one lies inside another: ep and edp inside "
                            f"dp_shard_cp, dp_shard inside dp, ...); combine dims that are independent")
        return members


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
