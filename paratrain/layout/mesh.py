"""The mesh every strategy receives: its named dims' process groups (`Axis`), comm stats and the comm guard.

`paratrain.layout.dims` is the pure rank math (which ranks form each group); `paratrain.comm.build_mesh` is the
collective step that creates the groups and hands back a `Mesh`. This module imports nothing of paratrain's
but the rank math (it is the bottom layer every strategy and `comm` build on).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from paratrain.layout.dims import Dim, MeshError, ParallelDims

__all__ = ["Axis", "Dim", "Mesh", "MeshError", "ParallelDims"]


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
    dims: tuple[str, ...] = ()  # the named dims it was built for, e.g. ("dp_cp",)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, local_index: int) -> int:
        return self.ranks[local_index]


class Mesh:
    """The explicit mesh object every strategy receives: the rank math (`dims`), one `Axis` per named dim
    and per combination the mesh was built with (`axis`), comm stats and the comm guard (timeouts and hang
    reports; the engine configures it from the config's `comm`)."""

    def __init__(self, dims: ParallelDims, rank: int, device_mesh, axes: dict[str, Axis], stats, guard=None,
                 owned_groups: Sequence = (), device_meshes: dict | None = None):
        self.owned_groups = list(owned_groups)  # the process groups build_mesh created for this rank
        self.dims = dims
        self.rank = rank
        self.device_mesh = device_mesh
        self._device_meshes = {k: v for k, v in (device_meshes or {}).items() if v is not None}
        self._axes = axes  # every named dim's (and every built combination's), by name
        self._by_members = {a.ranks: a for a in axes.values() if a.size > 1 and a.name != "world"}
        self.stats = stats
        self.guard = guard
        self.coords = dims.coords(rank)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def world(self) -> Axis:
        """Every rank (the default group)."""
        return self._axes["world"]

    def axis(self, names: str | Iterable[str]) -> Axis:
        """The group along `names` (one named dim, or several independent ones) that holds this rank: the
        axis of whichever named dim has those members (("dp", "cp") is "dp_cp"; "dp" alone when cp is 1)."""
        key = self.dims.canonical(names if isinstance(names, str) else tuple(names))
        if len(key) == 1:
            return self._axes[key[0]]
        members = tuple(self.dims.group_of(self.rank, key))
        if len(members) == 1:
            return self._axes[key[-1]]
        if members in self._by_members:
            return self._by_members[members]
        raise MeshError(f"no process group for dims {key}; build the mesh with it "
                        f"(paratrain.comm.build_mesh(dims, combine=[{key!r}]))")

    def size(self, names: str | Sequence[str]) -> int:
        return self.dims.size(names)

    def expert_axes(self) -> tuple[Axis, Axis] | None:
        """(ep, edp) when experts are split (expert_parallel.size > 1), else None."""
        return (self.axis("ep"), self.axis("edp")) if self.dims.ep > 1 else None

    def local_rank(self, name: str) -> int:
        """This rank's coordinate on the named dim."""
        return self.coords[name]

    def __getitem__(self, name: str | tuple[str, ...]):
        """The named sub-mesh as torch's DeviceMesh (`engine.mesh["dp"].get_local_rank()`, `mesh["tp"].size()`),
        the contract DeepSpeed-style scripts and torch's parallel APIs expect; a combination such as
        ("dp", "cp") is its flattened sub-mesh "dp_cp" (a size-1 one, the two-dimensional slice)."""
        key = self.dims.canonical(name)
        if len(key) > 1:  # a combination: the named dim with its members (("dp", "cp") is dp_cp)
            members = tuple(self.dims.group_of(self.rank, key))
            key = (self._by_members[members].name,) if members in self._by_members else key
        if len(key) == 1 and key[0] in self._device_meshes:
            return self._device_meshes[key[0]]
        return self.device_mesh[key[0] if len(key) == 1 else key]

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
        return f"Mesh({self.dims.describe()}, rank={self.rank}, coords={self.dims.grid_coords(self.rank)})"
