"""Creating the mesh's process groups: the collective step after the pure rank math of `paratrain.layout.mesh`.

    mesh = build_mesh(ParallelDims(world_size, dp=2, tp=2))   # every rank, same dims
"""

from __future__ import annotations

from collections.abc import Sequence

from paratrain.comm.guard import CommGuard
from paratrain.comm.stats import CommStats
from paratrain.layout.mesh import Axis, Mesh, MeshError, ParallelDims


def build_mesh(dims: ParallelDims, device_type: str = "cpu", stats=None, guard=None,
               combine: Sequence[Sequence[str]] = ()) -> Mesh:
    """Create the torch DeviceMesh of the grid and one process group per named dim of size > 1 (and per
    combination in `combine`): a grid dim is the DeviceMesh's own, a flattened dim its `_flatten`, the two
    factors of a split dim (ep and edp, USP's cp_ring and cp_ulysses) its `_unflatten` (torchtitan's dense and
    sparse views of one mesh). Dims with the same members share one group, named by the first (with no
    replication dp_shard is dp).

    Collective: every rank must call it with the same `dims`. `stats` (a CommStats) counts and `guard`
    (a CommGuard) watches every collective on the mesh's axes; fresh ones are made when not given.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise MeshError("torch.distributed is not initialized; call paratrain.init_distributed() first")
    if dist.get_world_size() != dims.world_size:
        raise MeshError(
            f"the layout is for {dims.world_size} processes but {dist.get_world_size()} were launched; "
            f"launch {dims.world_size} processes or change the parallel sizes"
        )
    rank = dist.get_rank()
    stats = stats if stats is not None else CommStats()
    guard = guard if guard is not None else CommGuard(rank)
    views = _DeviceViews(dims, device_type)
    axes: dict[str, Axis] = {}
    built: dict[tuple[int, ...], Axis] = {}
    wanted = [(n, (n,)) for n in dims.dims if n != "world"] + [("_".join(k), k) for k in map(dims.canonical, combine)]
    for name, key in wanted:
        members = tuple(dims.group_of(rank, key))
        if members in built:
            axes[name] = built[members]
            views.meshes[name] = views.meshes.get(built[members].name)
            continue
        group = views.group(name, key, members) if len(members) > 1 else None
        axes[name] = Axis(name, members, members.index(rank), group, stats, guard, key)
        if len(members) > 1:
            built[members] = axes[name]
    world = tuple(range(dims.world_size))
    axes["world"] = Axis("world", world, rank, dist.group.WORLD if dims.world_size > 1 else None, stats, guard,
                         ("world",))
    # A dim spanning the whole world is the default group itself: that one belongs to init_distributed.
    unique = [g for g in {id(g): g for g in views.created}.values() if g is not dist.GroupMember.WORLD]
    if dims.world_size > 1:
        _attach_failure_store(guard, dims.world_size)
    return Mesh(dims, rank, views.root, axes, stats, guard, owned_groups=unique, device_meshes=views.meshes)


class _DeviceViews:
    """The DeviceMesh of the grid and the sub-meshes cut from it, each group checked against the rank math.
    With no replication the grid's data-parallel dim is called "dp" (`engine.mesh["dp"]`, as torch's parallel
    APIs and DeepSpeed-style scripts expect); with replication "dp" is the flattening of dp_replicate x
    dp_shard."""

    def __init__(self, dims: ParallelDims, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        self.dims, self.created = dims, []
        self.rename = {"dp_shard": "dp"} if dims.dp_replicate == 1 else {}
        grid = [(self.rename.get(n, n), s) for n, s in dims.grid if not (n == "dp_replicate" and s == 1)]
        self.root = init_device_mesh(device_type, tuple(s for _, s in grid), mesh_dim_names=tuple(n for n, _ in grid))
        self.created += [self.root.get_group(n) for n, _ in grid]
        self.splits: dict[str, object] = {}
        self.meshes: dict[str, object] = {}  # each built dim's sub-mesh (a flattened one is kept, not re-sliced)

    def group(self, name: str, key: tuple[str, ...], members: tuple[int, ...]):
        import torch.distributed as dist

        if len(key) > 1:  # a combination of dims: groups of its own
            group = None
            for ranks in self.dims.groups(key):  # every rank creates every group (collective), keeps its own
                created = dist.new_group(list(ranks))
                if tuple(ranks) == members:
                    group = created
            self.created.append(group)
            return group
        dim = self.dims.dims[name]
        if dim.parent:
            sub = self._split(dim.parent)[name]
        else:
            real = tuple(self.rename.get(g, g) for g in dim.grid if self.dims.dims[g].size > 1)
            sub = self.root[real[0]] if len(real) == 1 else self.root[real]._flatten(name)
        if tuple(sub.mesh.flatten().tolist()) != members:
            raise MeshError(f"the DeviceMesh's {name} group {sub.mesh.flatten().tolist()} is not the rank math's "
                            f"{list(members)}")
        group = sub.get_group()
        self.created.append(group)
        self.meshes[name] = sub
        return group

    def _split(self, parent: str):
        """Both factors of `parent` (unflattened once, when both are larger than one)."""
        if parent not in self.splits:
            outer, inner = [d for d in self.dims.dims.values() if d.parent == parent]
            real = tuple(self.rename.get(g, g) for g in self.dims.dims[parent].grid if self.dims.dims[g].size > 1)
            base = self.root[real[0]] if len(real) == 1 else self.root[real]._flatten(parent)
            view = base._unflatten(0, (outer.size, inner.size), (outer.name, inner.name))
            self.splits[parent] = {outer.name: view[outer.name], inner.name: view[inner.name]}
        return self.splits[parent]


def _attach_failure_store(guard: CommGuard, world_size: int) -> None:
    """Give the guard a failure key of its own in the default group's store (see `guard.py`). Every rank adds 1
    to a counter once its groups exist; group creation is collective, so the adds of one mesh all land before
    any add of the next, and `(count - 1) // world_size` numbers the meshes alike on every rank."""
    from torch.distributed import distributed_c10d

    try:
        store = distributed_c10d._get_default_store()
        count = store.add("paratrain/meshes", 1)
    except Exception:  # noqa: BLE001 - without a store, errors still surface through the timeout
        return
    guard.attach_store(store, f"paratrain/failed/{(count - 1) // world_size}")
