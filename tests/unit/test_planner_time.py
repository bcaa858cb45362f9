"""Planner, time: ring collective costs, node placement, compute time, pipeline bubbles."""

from __future__ import annotations

from dataclasses import replace

import pytest

from paratrain.layout.dims import ParallelDims
from paratrain.models.gpt.model import GPTConfig
from paratrain.planner.hardware import Hardware, collective_seconds, spans_nodes
from paratrain.planner.layout import Layout
from paratrain.planner.model_shape import model_shape, shape_from_config
from paratrain.planner.step_time import bubble_factor, estimate_time

SPEC = shape_from_config(GPTConfig(vocab_size=256, seq_len=128, n_layer=8, n_head=8, d_model=128, bias=False))


def test_ring_collective_costs():
    bw, lat, size = 100e9, 1e-5, 8e9
    assert collective_seconds("all_reduce", size, 8, bw, lat) == pytest.approx(14 * lat + 2 * 7 / 8 * size / bw)
    assert collective_seconds("all_gather", size, 8, bw, lat) == pytest.approx(7 * lat + 7 / 8 * size / bw)
    assert collective_seconds("reduce_scatter", size, 8, bw, lat) == collective_seconds("all_gather", size, 8, bw, lat)
    assert collective_seconds("send", size, 2, bw, lat) == pytest.approx(lat + size / bw)
    assert collective_seconds("recv", size, 2, bw, lat) == 0.0  # the peer's send carries the time
    assert collective_seconds("all_reduce", size, 1, bw, lat) == 0.0
    # all-to-all: n - 1 pairwise steps, its payload already what leaves the rank (as paratrain.comm counts it)
    assert collective_seconds("all_to_all", size, 4, bw, lat) == pytest.approx(3 * lat + size / bw)
    with pytest.raises(ValueError, match="no ring model for collective 'gather'"):
        collective_seconds("gather", size, 2, bw, lat)


def test_groups_inside_or_across_nodes():
    # tp innermost: tp=8 groups fill a node of 8, dp groups cross nodes.
    assert not spans_nodes(ParallelDims(32, tp=8), ("tp",), 8)
    assert spans_nodes(ParallelDims(32, tp=8), ("dp",), 8)
    assert not spans_nodes(ParallelDims(8, cp=2, tp=2), ("dp", "cp"), 8)  # 8 ranks in all: one node
    assert spans_nodes(ParallelDims(16, tp=8), ("dp",), 8)
    assert spans_nodes(ParallelDims(16, tp=16), ("tp",), 8)
    assert not spans_nodes(ParallelDims(6, tp=2), ("tp",), 4)  # groups {0,1} {2,3} {4,5}: none straddles a node
    assert spans_nodes(ParallelDims(6, tp=2), ("dp",), 4)
    # HSDP: shard inside a node, replicate across; experts inside the shard group stay in it
    assert not spans_nodes(ParallelDims(16, dp_replicate=2), ("dp_shard",), 8)
    assert spans_nodes(ParallelDims(16, dp_replicate=2), ("dp_replicate",), 8)
    assert not spans_nodes(ParallelDims(16, ep=8), ("ep",), 8)  # 8 consecutive ranks: one node
    assert spans_nodes(ParallelDims(16, ep=8), ("edp",), 8)  # ranks i, i + 8: two nodes
    assert spans_nodes(ParallelDims(32, tp=2, ep=8), ("ep",), 8)  # tp inside: an ep group spans 16 ranks


def test_single_gpu_step_is_flops_over_peak_times_mfu_plus_the_optimizer():
    hw = Hardware(peak_flops=100e12, mfu=0.5, memory_bandwidth=1e12)
    layout = Layout(dp=1, micro_batch=4, grad_accum=2, precision="bf16")
    t = estimate_time(SPEC, layout, hw)
    tokens = 8 * SPEC.seq_len
    assert t.compute == pytest.approx(tokens * SPEC.flops_per_token / 50e12)
    assert t.bubble == 0 and t.comm == {}
    assert t.optimizer == pytest.approx(28 * SPEC.params / 1e12)
    assert t.mfu(100e12) == pytest.approx(0.5 * t.compute / t.total)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_pipeline_bubble_fraction(p, m):
    hw = Hardware(latency=0.0, intra_node_bandwidth=1e30)  # no communication cost: compute and bubble only
    layout = Layout(dp=1, micro_batch=1, grad_accum=m, pp=p, schedule="1f1b", precision="bf16")
    t = estimate_time(SPEC, layout, hw)
    assert t.bubble / (t.bubble + t.compute) == pytest.approx((p - 1) / (m + p - 1))
    assert estimate_time(SPEC, replace(layout, schedule="gpipe"), hw).bubble == pytest.approx(t.bubble)
    assert bubble_factor(replace(layout, schedule="zb-h1")) == pytest.approx((p - 1) / 3)
    assert bubble_factor(replace(layout, schedule="interleaved", virtual_stages=2)) == pytest.approx((p - 1) / 2)
    # The V schedules: the simulator's idle slots per rank over one micro-batch's 6 chunk slots (F, B, W of two
    # chunks), the planner's unit of a stage's forward + backward.
    from paratrain.parallel.pp.schedules import build_schedule
    from paratrain.parallel.pp.validate import simulate

    for name in ("zb-v", "dualpipev"):
        sim = simulate(build_schedule(name, p, m, 2))
        assert bubble_factor(replace(layout, schedule=name, virtual_stages=2)) == pytest.approx(max(sim.idle_slots) / 6)


def test_recompute_costs_a_forward():
    hw = Hardware()
    base = Layout(dp=1, micro_batch=1, grad_accum=1, precision="bf16")
    plain = estimate_time(SPEC, base, hw).compute
    full = estimate_time(SPEC, replace(base, recompute="full"), hw).compute
    layers = SPEC.n_layer * (6 * SPEC.layer_params() + SPEC.attention_flops_per_token_per_layer())
    assert full - plain == pytest.approx(plain * layers / SPEC.flops_per_token / 3)


def test_more_sharding_costs_more_data_parallel_traffic_and_slow_links_cost_more():
    spec = model_shape("gpt-1.3b")
    hw = Hardware(overlap=0.0)  # nothing hidden: the exposed time is the whole collective
    base = Layout(dp=16, micro_batch=1, grad_accum=1, precision="bf16")
    times = [sum(estimate_time(spec, replace(base, zero_stage=z), hw).comm.values()) for z in (0, 3)]
    assert times[1] > times[0]
    fast = Hardware(gpus_per_node=16, overlap=0.0)
    assert sum(estimate_time(spec, base, fast).comm.values()) < sum(estimate_time(spec, base, hw).comm.values())
