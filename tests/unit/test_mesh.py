"""Rank math of ParallelDims, checked in one process (no torch.distributed)."""

import pytest

from paratrain.layout.mesh import AXES, MeshError, ParallelDims


def test_dp_minus_one_takes_the_rest():
    dims = ParallelDims(8, dp=-1, pp=2, tp=2)
    assert dims.dp == 2 and dims.shape == (2, 2, 1, 2)


def test_product_must_equal_world():
    with pytest.raises(MeshError, match=r"dp\*pp\*cp\*tp = 2\*2\*1\*1 = 4, but the world size is 8"):
        ParallelDims(8, dp=2, pp=2)
    with pytest.raises(MeshError, match="does not divide the world size 6"):
        ParallelDims(6, pp=4)
    with pytest.raises(MeshError, match="tp size must be a positive integer"):
        ParallelDims(4, tp=0)


def test_coords_round_trip_and_tp_is_innermost():
    dims = ParallelDims(16, dp=2, pp=2, cp=2, tp=2)
    for rank in range(16):
        assert dims.rank_at(dims.coords(rank)) == rank
    assert dims.coords(1) == {"dp": 0, "pp": 0, "cp": 0, "tp": 1}
    assert dims.coords(8) == {"dp": 1, "pp": 0, "cp": 0, "tp": 0}


def test_groups_partition_the_world():
    dims = ParallelDims(8, dp=2, pp=2, tp=2)
    for axes in list(AXES) + [("dp", "cp"), ("pp", "tp")]:
        groups = dims.groups(axes)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(8))
        assert all(len(g) == dims.size(axes) for g in groups)
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.group_of(5, ("pp", "tp")) == [4, 5, 6, 7]


def test_members_of_a_group_differ_only_on_its_axes():
    dims = ParallelDims(24, dp=3, pp=2, cp=2, tp=2)
    for axes in [("dp",), ("cp", "tp"), ("dp", "cp")]:
        for group in dims.groups(axes):
            coords = [dims.coords(r) for r in group]
            for other in set(AXES) - set(axes):
                assert len({c[other] for c in coords}) == 1


def test_unknown_axis_is_named():
    with pytest.raises(MeshError, match="unknown mesh axis 'ep'"):
        ParallelDims(2).groups("ep")


@pytest.mark.parametrize("world,pp,cp,tp", [(8, 1, 2, 1), (8, 2, 2, 1), (16, 1, 4, 2), (4, 1, 1, 1), (8, 1, 8, 1)])
def test_samples_split_over_dp_and_gradients_average_over_dp_x_cp(world, pp, cp, tp):
    """The two meanings of "data-parallel", and the config's batch arithmetic counting the first."""
    from paratrain.config import load_config, resolve_batch

    dims = ParallelDims(world, pp=pp, cp=cp, tp=tp)
    assert dims.sample_parallel_size == dims.dp == world // (pp * cp * tp)
    assert dims.gradient_average_size == dims.dp * cp == dims.size(("dp", "cp"))
    config = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "pipeline":
                          {"stages": pp}, "context_parallel": {"size": cp}, "tensor_parallel": {"size": tp}})
    assert config.dp_size(world) == dims.sample_parallel_size
    assert resolve_batch(config, world).train_batch_size == 2 * 3 * dims.sample_parallel_size
