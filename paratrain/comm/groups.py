"""Creating the mesh's process groups: the collective step after the pure rank math of `paratrain.layout.mesh`.

    mesh = build_mesh(ParallelDims(world_size, dp=2, tp=2))   # every rank, same dims
"""

from __future__ import annotations

from paratrain.comm.guard import CommGuard
from paratrain.comm.stats import CommStats
from paratrain.layout.mesh import AXES, COMBINED_AXES, Axis, Mesh, MeshError, ParallelDims


def build_mesh(dims: ParallelDims, device_type: str = "cpu", stats=None, guard=None) -> Mesh:
    """Create the torch DeviceMesh and one process group per axis (and per combined axis, as the DeviceMesh's
    flattened sub-meshes: `mesh.device_mesh["dp_cp"]`).

    Collective: every rank must call it with the same `dims`. `stats` (a CommStats) counts and `guard`
    (a CommGuard) watches every collective on the mesh's axes; fresh ones are made when not given.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

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
    device_mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)
    owned = [device_mesh.get_group(name) for name in AXES]
    axes: dict[tuple[str, ...], Axis] = {}
    for name in AXES:
        members = dims.group_of(rank, name)
        group = device_mesh.get_group(name) if len(members) > 1 else None
        axes[(name,)] = Axis(name, tuple(members), members.index(rank), group, stats, guard, (name,))
    for combo in COMBINED_AXES:
        members = dims.group_of(rank, combo)
        # A combination with only one axis of size > 1 is that axis: reuse its group and its name, so
        # e.g. gradient traffic over ("dp", "cp") is counted under "dp" when cp == 1.
        real = [a for a in combo if dims.sizes[a] > 1]
        if len(real) == 1:
            axes[combo] = axes[(real[0],)]
            continue
        name = "_".join(combo)
        group = None
        if len(members) > 1:
            # The DeviceMesh's flattened sub-mesh (torchtitan's `mesh["dp", "cp"]._flatten()`): every rank
            # creates every group of the combination (collective) and the mesh keeps its own as mesh[name].
            group = device_mesh[combo]._flatten(name).get_group()
            owned.append(group)
        axes[combo] = Axis(name, tuple(members), members.index(rank), group, stats, guard, combo)
    sub_axes: dict[str, Axis] = {}
    subgroups = [(name, groups, ("cp",)) for name, groups in dims.cp_subgroups().items()]  # USP
    subgroups += [(name, groups, ("dp", "cp")) for name, groups in dims.expert_subgroups().items()]  # experts
    for name, all_groups, spans in subgroups:  # every rank creates every group (collective), keeps its own
        for ranks in all_groups:
            created = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                if created is not None:
                    owned.append(created)
                sub_axes[name] = Axis(name, tuple(ranks), ranks.index(rank), created, stats, guard, spans)
    world = tuple(range(dims.world_size))
    axes[AXES] = Axis("world", world, rank, dist.group.WORLD if dims.world_size > 1 else None, stats, guard, AXES)
    # A dim spanning the whole world is the default group itself: that one belongs to init_distributed.
    unique = [g for g in {id(g): g for g in owned}.values() if g is not dist.GroupMember.WORLD]
    if dims.world_size > 1:
        _attach_failure_store(guard, dims.world_size)
    return Mesh(dims, rank, device_mesh, axes, stats, guard, owned_groups=unique, sub_axes=sub_axes)


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
