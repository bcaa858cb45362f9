"""Rank math of ParallelDims, checked in one process (no torch.distributed)."""

import pytest

from paratrain.layout.dims import MeshError, ParallelDims

GRID = ("dp_replicate", "dp_shard", "pp", "cp", "tp")


def test_dp_minus_one_takes_the_rest():
    dims = ParallelDims(8, dp=-1, pp=2, tp=2)
    assert dims.dp == 2 and dims.shape == (1, 2, 2, 1, 2)
    hsdp = ParallelDims(8, dp=-1, pp=2, dp_replicate=2)
    assert (hsdp.dp, hsdp.dp_shard, hsdp.shape) == (4, 2, (2, 2, 2, 1, 1))


def test_product_must_equal_world():
    with pytest.raises(MeshError, match=r"dp\*pp\*cp\*tp = 2\*2\*1\*1 = 4, but the world size is 8"):
        ParallelDims(8, dp=2, pp=2)
    with pytest.raises(MeshError, match="does not divide the world size 6"):
        ParallelDims(6, pp=4)
    with pytest.raises(MeshError, match="tp size must be a positive integer"):
        ParallelDims(4, tp=0)
    with pytest.raises(MeshError, match=r"data_parallel.replicate 3 must divide the data-parallel size 4.*\[1, 2, 4\]"):
        ParallelDims(4, dp_replicate=3)
    with pytest.raises(MeshError, match=r"expert_parallel.size 4 .* must divide dp / data_parallel.replicate x cp = "
                                        r"2x1 = 2"):
        ParallelDims(4, dp_replicate=2, ep=4)


def test_coords_round_trip_and_tp_is_innermost():
    dims = ParallelDims(16, dp=2, pp=2, cp=2, tp=2)
    for rank in range(16):
        assert dims.rank_at(dims.grid_coords(rank)) == rank
    assert dims.grid_coords(1) == {"dp_replicate": 0, "dp_shard": 0, "pp": 0, "cp": 0, "tp": 1}
    assert dims.grid_coords(8) == {"dp_replicate": 0, "dp_shard": 1, "pp": 0, "cp": 0, "tp": 0}
    coords = dims.coords(11)  # dp 1, pp 0, cp 1, tp 1: every named dim's coordinate
    assert (coords["dp"], coords["pp"], coords["cp"], coords["tp"], coords["dp_cp"]) == (1, 0, 1, 1, 3)


def test_groups_partition_the_world():
    dims = ParallelDims(8, dp=2, pp=2, tp=2)
    for names in ["dp", "pp", "cp", "tp", "dp_cp", "dp_shard_cp", ("pp", "tp"), ("dp", "tp")]:
        groups = dims.groups(names)
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert all(len(g) == dims.size(names) for g in groups)
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.group_of(5, ("tp", "pp")) == [4, 5, 6, 7]  # outer dim first, whatever order they are named in


def test_members_of_a_group_differ_only_on_its_dims():
    dims = ParallelDims(48, dp=6, pp=2, cp=2, tp=2, dp_replicate=3)
    for names, moving in [("dp", {"dp_replicate", "dp_shard"}), (("cp", "tp"), {"cp", "tp"}),
                          ("dp_cp", {"dp_replicate", "dp_shard", "cp"}), ("dp_shard_cp", {"dp_shard", "cp"}),
                          ("dp_replicate", {"dp_replicate"})]:
        for group in dims.groups(names):
            coords = [dims.grid_coords(r) for r in group]
            for other in set(GRID) - moving:
                assert len({c[other] for c in coords}) == 1, (names, other)


def test_hsdp_shards_inside_and_replicates_across():
    """dp = replicate x shard, replicate outermost: on 8 ranks of two 4-rank nodes, each shard group is one node
    and each replica group spans the two."""
    dims = ParallelDims(8, dp_replicate=2)
    assert dims.groups("dp_shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups("dp") == [list(range(8))]
    assert dims.axis_name("dp_shard_cp") == "dp_shard" and dims.axis_name(("dp", "cp")) == "dp"


def test_experts_split_the_shard_group_and_usp_splits_cp():
    dims = ParallelDims(12, dp=6, cp=2, ep=4)
    # the 12 members of dp_shard x cp in mesh order: ep runs of 4 consecutive ones, edp the same index mod 4
    assert dims.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert dims.groups("edp") == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    hsdp = ParallelDims(8, dp_replicate=2, ep=2)  # experts fold inside the shard group, replicated across
    assert hsdp.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]] and hsdp.groups("edp")[0] == [0, 2]
    usp = ParallelDims(8, dp=1, cp=8, cp_ulysses=2)
    assert usp.groups("cp_ulysses")[0] == [0, 1] and usp.groups("cp_ring")[0] == [0, 2, 4, 6]
    with pytest.raises(MeshError, match="overlap"):
        dims.groups(("ep", "dp"))


def test_group_names_follow_the_first_dim_with_the_same_members():
    assert ParallelDims(4).axis_name(("dp", "cp")) == "dp"
    assert ParallelDims(8, cp=2).axis_name(("cp", "dp")) == "dp_cp"
    assert ParallelDims(4, tp=4).axis_name("dp_cp") is None
    assert ParallelDims(4).axis_name("world") == "world" and ParallelDims(1).axis_name("world") is None
    assert ParallelDims(8, pp=2, tp=2).axis_name(("pp", "tp")) == "pp_tp"  # a combination of its own


def test_unknown_dim_is_named():
    with pytest.raises(MeshError, match="unknown mesh dim 'xp'"):
        ParallelDims(2).groups("xp")


@pytest.mark.parametrize("world,pp,cp,tp", [(8, 1, 2, 1), (8, 2, 2, 1), (16, 1, 4, 2), (4, 1, 1, 1), (8, 1, 8, 1)])
def test_samples_split_over_dp_and_gradients_average_over_dp_x_cp(world, pp, cp, tp):
    """The two meanings of "data-parallel", and the config's batch arithmetic counting the first."""
    from paratrain.config import load_config, resolve_batch

    dims = ParallelDims(world, pp=pp, cp=cp, tp=tp)
    assert dims.sample_parallel_size == dims.dp == world // (pp * cp * tp)
    assert dims.gradient_average_size == dims.dp * cp == dims.size(("dp", "cp")) == dims.size("dp_cp")
    config = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "pipeline":
                          {"stages": pp}, "context_parallel": {"size": cp}, "tensor_parallel": {"size": tp}})
    assert config.dp_size(world) == dims.sample_parallel_size
    assert resolve_batch(config, world).train_batch_size == 2 * 3 * dims.sample_parallel_size


def test_the_summary_layout_names_the_zero_stage_and_hsdp_and_an_unsharded_zero_is_warned_about():
    from paratrain.api import layout_label, unsharded_zero

    assert layout_label(ParallelDims(2, dp=2), 3) == "dp2 ZeRO-3"
    assert layout_label(ParallelDims(2, dp=2), 0) == "dp2"
    assert layout_label(ParallelDims(4, dp=4, dp_replicate=2), 3) == "dp4 (HSDP: replicate 2 x shard 2) ZeRO-3"
    assert layout_label(ParallelDims(2, cp=2), 1) == "cp2 ZeRO-1"  # ZeRO shards over dp_shard x cp
    assert layout_label(ParallelDims(2, tp=2), 3) == "tp2"  # nothing sharded: the stage does nothing
    assert unsharded_zero(3, ParallelDims(2, dp=2)) is None and unsharded_zero(0, ParallelDims(2, tp=2)) is None
    assert unsharded_zero(3, ParallelDims(2, tp=2)) == (
        "zero_optimization.stage 3 shards over the data x context-parallel ranks, of which this layout (tp2) has 1: "
        "nothing is sharded; raise data_parallel.size (or lower tensor_parallel / pipeline sizes), or set "
        "zero_optimization.stage to 0")
    assert unsharded_zero(2, ParallelDims(4, dp=2, dp_replicate=2, tp=2)) is not None  # replicas only: no shards
