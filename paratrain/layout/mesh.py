"""The device mesh: pure rank math (`ParallelDims`) and the process groups built from it (`Mesh`).

Ranks are laid out as a 4-d grid `arange(world).view(dp, pp, cp, tp)` (picotron's grid). `tp` is the
innermost axis so that a tensor-parallel group is a run of consecutive ranks (one node's fast links on a
GPU cluster); `dp` is the outermost because its traffic is the most tolerant of slow links.

`ParallelDims` never touches torch.distributed, so every layout can be unit-tested in one process.
`paratrain.comm.build_mesh` is the separate, collective step that creates the groups; this module imports
nothing of paratrain's (it is the bottom layer every strategy and `comm` build on).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from paratrain.errors import Error

AXES: tuple[str, ...] = ("dp", "pp", "cp", "tp")

# Combined axes that strategies reduce over. Every rank creates the same groups in the same order,
# which gloo and NCCL require; a strategy needing another combination adds it here.
COMBINED_AXES: tuple[tuple[str, ...], ...] = (("dp", "cp"), ("pp", "tp"), ("cp", "tp"), ("dp", "cp", "tp"))


class MeshError(Error, ValueError):
    """A layout that cannot be built; the message names the sizes and the fix."""


def _axis_tuple(axes: str | Sequence[str]) -> tuple[str, ...]:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for name in names:
        if name not in AXES:
            raise MeshError(f"unknown mesh axis {name!r}; the axes are {', '.join(AXES)}")
    # Canonical order (outer to inner) so ("cp", "dp") and ("dp", "cp") are the same group.
    return tuple(a for a in AXES if a in names)


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the four mesh axes. `dp=-1` means "whatever is left of the world"."""

    world_size: int
    dp: int = -1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    cp_ulysses: int = 1  # USP: ranks of a cp group that share a ring rank's tokens (Ulysses inside, ring across)
    ep: int = 1  # expert parallelism, folded inside dp x cp (`expert_subgroups`)
    sizes: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise MeshError(f"world_size must be >= 1, got {self.world_size}")
        for name in ("pp", "cp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MeshError(f"{name} size must be a positive integer, got {value!r}")
        model_parallel = self.pp * self.cp * self.tp
        if self.dp == -1:
            if self.world_size % model_parallel:
                raise MeshError(
                    f"pp*cp*tp = {self.pp}*{self.cp}*{self.tp} = {model_parallel} does not divide the world size "
                    f"{self.world_size}; choose sizes whose product divides {self.world_size}"
                )
            object.__setattr__(self, "dp", self.world_size // model_parallel)
        elif not isinstance(self.dp, int) or self.dp < 1:
            raise MeshError(f"dp size must be a positive integer or -1 (the rest), got {self.dp!r}")
        product = self.dp * model_parallel
        if product != self.world_size:
            raise MeshError(
                f"dp*pp*cp*tp = {self.dp}*{self.pp}*{self.cp}*{self.tp} = {product}, but the world size is "
                f"{self.world_size}; set dp=-1 to use the rest, or change the sizes so the product is "
                f"{self.world_size}"
            )
        object.__setattr__(self, "sizes", {a: getattr(self, a) for a in AXES})
        if not isinstance(self.cp_ulysses, int) or self.cp_ulysses < 1 or self.cp % self.cp_ulysses:
            raise MeshError(f"the Ulysses size {self.cp_ulysses!r} must be a positive divisor of cp ({self.cp})")
        folded = self.dp * self.cp
        if not isinstance(self.ep, int) or self.ep < 1 or folded % self.ep:
            works = [d for d in range(1, folded + 1) if folded % d == 0]
            raise MeshError(f"expert_parallel.size {self.ep!r} (deepspeed.moe.layer.MoE's ep_size sets it) must "
                            f"divide dp x cp = {self.dp}x{self.cp} = {folded} (the experts are split over ranks "
                            f"that see different tokens); use one of {works}")

    def cp_subgroups(self) -> dict[str, list[list[int]]]:
        """USP's two sub-axes of every cp group (cp index c = ring index · u + Ulysses index): "cp_ulysses"
        groups are runs of u consecutive cp indices, "cp_ring" groups the indices with the same c mod u. Empty
        unless 1 < cp_ulysses < cp."""
        u = self.cp_ulysses
        if not 1 < u < self.cp:
            return {}
        out: dict[str, list[list[int]]] = {"cp_ring": [], "cp_ulysses": []}
        for members in self.groups("cp"):
            out["cp_ulysses"] += [members[i * u:(i + 1) * u] for i in range(self.cp // u)]
            out["cp_ring"] += [members[j::u] for j in range(u)]
        return out

    def expert_subgroups(self) -> dict[str, list[list[int]]]:
        """Expert parallelism folded inside each dp x cp group (Megatron's "parallel folding"): with the
        group's members in mesh order (index i), "ep" groups are runs of ep consecutive members (they split
        the experts and exchange tokens), "edp" groups the members with the same i mod ep (they hold the same
        experts: the expert-data-parallel group, over which expert gradients are reduced and ZeRO shards
        them). Empty when ep is 1."""
        if self.ep == 1:
            return {}
        out: dict[str, list[list[int]]] = {"ep": [], "edp": []}
        for members in self.groups(("dp", "cp")):
            out["ep"] += [members[i:i + self.ep] for i in range(0, len(members), self.ep)]
            out["edp"] += [members[j::self.ep] for j in range(self.ep)]
        return out

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks holding the same experts: dp x cp / ep."""
        return self.dp * self.cp // self.ep

    # ---- what "data-parallel" counts ------------------------------------------------------------------
    @property
    def sample_parallel_size(self) -> int:
        """Ranks that draw different samples: dp. The batch arithmetic counts these (global batch = micro-batch
        x accumulation steps x dp): context-parallel ranks hold other tokens of the same samples, and pipeline
        and tensor-parallel ranks the same tokens. DeepSpeed's `dp_world_size` (without sequence parallelism)."""
        return self.dp

    @property
    def gradient_average_size(self) -> int:
        """Ranks whose gradients are averaged, and over which ZeRO shards: dp x cp, because context-parallel
        ranks computed their gradients from different tokens. DeepSpeed's `seq_dp_world_size`."""
        return self.dp * self.cp

    # ---- pure rank math -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[a] for a in AXES)

    def size(self, axes: str | Sequence[str]) -> int:
        out = 1
        for a in _axis_tuple(axes):
            out *= self.sizes[a]
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of `rank` on each axis, e.g. {"dp": 1, "pp": 0, "cp": 0, "tp": 1}."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the world of size {self.world_size}")
        out: dict[str, int] = {}
        for a in reversed(AXES):
            out[a] = rank % self.sizes[a]
            rank //= self.sizes[a]
        return {a: out[a] for a in AXES}

    def rank_at(self, coords: dict[str, int]) -> int:
        rank = 0
        for a in AXES:
            c = coords.get(a, 0)
            if not 0 <= c < self.sizes[a]:
                raise MeshError(f"coordinate {a}={c} is outside the axis of size {self.sizes[a]}")
            rank = rank * self.sizes[a] + c
        return rank

    def groups(self, axes: str | Sequence[str]) -> list[list[int]]:
        """Every group along `axes`: ranks that differ only in those coordinates, in a fixed order."""
        names = _axis_tuple(axes)
        fixed = [a for a in AXES if a not in names]
        out = []
        for fixed_coords in itertools.product(*(range(self.sizes[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_coords))
            members = []
            for moving in itertools.product(*(range(self.sizes[a]) for a in names)):
                members.append(self.rank_at({**base, **dict(zip(names, moving))}))
            out.append(members)
        return out

    def group_of(self, rank: int, axes: str | Sequence[str]) -> list[int]:
        """The members of the group along `axes` that contains `rank`."""
        for members in self.groups(axes):
            if rank in members:
                return members
        raise AssertionError("unreachable: every rank lies in exactly one group per axis set")

    def describe(self) -> str:
        described = " x ".join(f"{a}{self.sizes[a]}" for a in AXES if self.sizes[a] > 1) or "single process"
        return described + (f" (ep{self.ep} folded in dp x cp)" if self.ep > 1 else "")


@dataclass(frozen=True)
class Axis:
    """One communication group on the mesh: a name for accounting plus the torch process group.

    `group` is None when the axis has size 1: collectives on it are skipped (and not counted), which
    is what a size-1 group would do anyway, minus the latency.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int  # this process's index inside `ranks`
    group: object | None
    stats: object = field(default=None, compare=False, repr=False)  # CommStats that counts this axis
    guard: object = field(default=None, compare=False, repr=False)  # CommGuard that times its waits
    dims: tuple[str, ...] = ()  # the mesh axes it spans, e.g. ("dp", "cp"); ("dp",) when cp is 1

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, local_index: int) -> int:
        return self.ranks[local_index]


class Mesh:
    """The explicit mesh object every strategy receives: sizes, axes (process groups), comm stats and
    the comm guard (timeouts and hang reports; the engine configures it from the config's `comm`)."""

    def __init__(self, dims: ParallelDims, rank: int, device_mesh, axes: dict[tuple[str, ...], Axis], stats,
                 guard=None, owned_groups: Sequence = (), sub_axes: dict[str, Axis] | None = None):
        self.owned_groups = list(owned_groups)  # the process groups build_mesh created for this rank
        # USP's cp_ring and cp_ulysses (`ParallelDims.cp_subgroups`); ep and edp (`ParallelDims.expert_subgroups`)
        self.sub_axes = dict(sub_axes or {})
        self.dims = dims
        self.rank = rank
        self.device_mesh = device_mesh
        self._axes = axes
        self.stats = stats
        self.guard = guard
        self.coords = dims.coords(rank)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def axis(self, axes: str | Iterable[str]) -> Axis:
        key = _axis_tuple(axes if isinstance(axes, str) else tuple(axes))
        if key not in self._axes:
            raise MeshError(f"no process group for axes {key}; add it to paratrain.layout.mesh.COMBINED_AXES")
        return self._axes[key]

    def size(self, axes: str | Sequence[str]) -> int:
        return self.dims.size(axes)

    def expert_axes(self) -> tuple[Axis, Axis] | None:
        """(ep, edp) when experts are split (expert_parallel.size > 1), else None."""
        if "ep" not in self.sub_axes:
            return None
        return self.sub_axes["ep"], self.sub_axes["edp"]

    def local_rank(self, axis: str) -> int:
        return self.coords[axis]

    def __getitem__(self, name: str | tuple[str, ...]):
        """The named sub-mesh as torch's DeviceMesh (`engine.mesh["dp"].get_local_rank()`, `mesh["tp"].size()`),
        the contract DeepSpeed-style scripts and torch's parallel APIs expect; a combined axis such as
        ("dp", "cp") is its flattened sub-mesh "dp_cp" (a size-1 one, the two-dimensional slice)."""
        names = (name,) if isinstance(name, str) else tuple(name)
        key = _axis_tuple(names)
        if len(key) == 1:
            return self.device_mesh[key[0]]
        try:  # flattened when it spans more than one rank (comm/groups.py)
            return self.device_mesh["_".join(key)]
        except KeyError:
            return self.device_mesh[key]

    def destroy(self) -> None:
        """Destroy the process groups this mesh created (collective: every rank, after its last collective
        on the mesh). torch keeps every group until it is destroyed, and gloo keeps threads per group, so a
        long-lived process that builds engine after engine should destroy each one it is done with."""
        import torch.distributed as dist

        dist.barrier()  # no rank may drop a group a peer is still waiting in
        for group in self.owned_groups:
            dist.destroy_process_group(group)
        self.owned_groups = []

    def __repr__(self) -> str:
        return f"Mesh({self.dims.describe()}, rank={self.rank}, coords={self.coords})"
