"""Planner, communication: per-rank payloads per axis against the formulas of docs/planner.md (communication
per optimizer step)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from paratrain.models.gpt.model import GPTConfig
from paratrain.planner.comm import predict_comm, rank_transfers
from paratrain.planner.hardware import RING_MOVED
from paratrain.planner.layout import Layout
from paratrain.planner.memory import rank_params
from paratrain.planner.model_shape import shape_from_config

SPEC = shape_from_config(GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=8, d_model=64, bias=False))
PSI = SPEC.params
SCALAR = {"elements": 1, "bytes": 4}


def _ops(layout: Layout, axis: str, stage: int = 0, kinds=None) -> dict:
    """{op: elements} on `axis`, without the bookkeeping scalars."""
    out: dict[str, int] = {}
    for t in rank_transfers(SPEC, layout, stage):
        if layout.dims.axis_name(t.axes) == axis and t.kind != "scalar" and (kinds is None or t.kind in kinds):
            out[t.op] = out.get(t.op, 0) + t.elements
    return out


def test_ddp_one_all_reduce_of_psi_plus_the_loss_sum_and_count_and_the_norm():
    layout = Layout(dp=4, micro_batch=2, grad_accum=3, precision="fp32")  # the token loss's two fp64 numbers
    # every DDP rank holds the whole gradient: its norm needs no collective
    assert predict_comm(SPEC, layout) == {"dp": {"all_reduce": {"elements": PSI + 2, "bytes": 4 * PSI + 16}}}
    # once anything splits the gradient (ZeRO, tp), the squared norm's sum goes over the world
    assert predict_comm(SPEC, replace(layout, zero_stage=1))["world"] == {"all_reduce": SCALAR}
    assert predict_comm(SPEC, replace(layout, dp=2, tp=2))["world"] == {"all_reduce": SCALAR}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zero_stages(n):
    padded = -(-PSI // n) * n
    base = Layout(dp=n, micro_batch=1, grad_accum=1, precision="fp32")
    ddp = _ops(base, "dp")
    assert ddp == {"all_reduce": PSI}
    assert _ops(replace(base, zero_stage=1), "dp") == {"reduce_scatter": padded, "all_gather": padded}
    assert _ops(replace(base, zero_stage=2), "dp") == {"reduce_scatter": padded, "all_gather": padded}
    zero3 = _ops(replace(base, zero_stage=3), "dp")
    # Units: each block, gathered for its forward and again for its backward; the root (embedding, final
    # norm, head) gathered once, kept from its forward through its backward. Each unit padded to N.
    blocks = SPEC.n_layer * (-(-SPEC.layer_params() // n) * n)
    root = -(-(SPEC.embed_params() + SPEC.head_params()) // n) * n
    assert zero3 == {"all_gather": 2 * blocks + root, "reduce_scatter": blocks + root}
    # 1.5x DDP's wire bytes, less the root's second gather
    assert sum(zero3.values()) + root == pytest.approx(1.5 * 2 * ddp["all_reduce"], rel=4 * n / PSI)
    # Under accumulation ZeRO-2 (gradients sharded) reduces every micro-batch, ZeRO-1 once per step.
    assert _ops(replace(base, zero_stage=1, grad_accum=4), "dp")["reduce_scatter"] == padded
    assert _ops(replace(base, zero_stage=2, grad_accum=4), "dp")["reduce_scatter"] == 4 * padded
    assert _ops(replace(base, zero_stage=3, grad_accum=4), "dp")["all_gather"] == 4 * (2 * blocks + root)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hsdp_shards_over_the_shard_group_and_sums_each_shard_over_the_replicas_once(stage):
    """dp 8 = 2 replicas x 4 shards: ZeRO's collectives over the shard group, padded to 4, plus one all-reduce of
    each gradient shard over dp_replicate per step (whatever the accumulation)."""
    layout = Layout(dp=8, dp_replicate=2, zero_stage=stage, micro_batch=1, grad_accum=3, precision="fp32")
    flat = Layout(dp=4, zero_stage=stage, micro_batch=1, grad_accum=3, precision="fp32")  # one shard group alone
    assert _ops(layout, "dp_shard") == _ops(flat, "dp")
    shards = [-(-PSI // 4)] if stage < 3 else \
        [-(-SPEC.layer_params() // 4)] * SPEC.n_layer + [-(-(SPEC.embed_params() + SPEC.head_params()) // 4)]
    assert _ops(layout, "dp_replicate") == {"all_reduce": sum(shards)}
    assert layout.dims.axis_name("dp_shard_cp") == "dp_shard" and flat.dims.axis_name("dp_shard_cp") == "dp"


def test_the_search_puts_replicas_across_nodes_and_shards_inside():
    from paratrain.planner.enumerate import SearchSpace, hsdp_variants

    zero3 = Layout(dp=16, zero_stage=3, micro_batch=1, grad_accum=1)
    assert [v.dp_replicate for v in hsdp_variants(zero3, 8, SearchSpace())] == [2]  # two nodes of 8: shard 8
    assert hsdp_variants(zero3, 16, SearchSpace()) == []  # one node: nothing to gain
    assert hsdp_variants(replace(zero3, zero_stage=0), 8, SearchSpace()) == []  # DDP replicates already
    assert [v.dp_replicate for v in hsdp_variants(replace(zero3, dp=8, tp=2), 8, SearchSpace())] == [2]


@pytest.mark.parametrize("m", [1, 3])
def test_tensor_parallel_two_all_reduces_each_way_per_layer(m):
    layout = Layout(dp=1, micro_batch=2, grad_accum=m, tp=4, precision="bf16")
    bsh = 2 * SPEC.seq_len * SPEC.d_model
    ops = _ops(layout, "tp")
    # 4 per layer, + the vocab-parallel embedding's output and the column-parallel head's input gradient,
    # + the vocab-parallel loss's three fp32 (b, s) vectors.
    assert ops == {"all_reduce": m * (4 * SPEC.n_layer + 2) * bsh + m * 3 * 2 * SPEC.seq_len}
    full = _ops(replace(layout, recompute="full"), "tp")["all_reduce"]
    assert full - ops["all_reduce"] == m * 2 * SPEC.n_layer * bsh  # forward collectives run again


def test_sequence_parallel_moves_the_same_bytes_on_the_wire():
    t, m = 4, 2
    plain = Layout(dp=1, micro_batch=2, grad_accum=m, tp=t, precision="bf16")
    sp = replace(plain, sequence_parallel=True)
    bsh = 2 * SPEC.seq_len * SPEC.d_model

    def wire(layout):  # activations, not the loss's vectors or SP's norm gradients
        return sum(RING_MOVED[x.op](t) * x.bytes for x in rank_transfers(SPEC, layout)
                   if x.axes == ("tp",) and x.elements >= bsh)

    ops = _ops(sp, "tp")
    # The GPT's embedding all-reduces (token + position embeddings are summed before the split to s/tp), so
    # it has one all-gather (its gradient) more than reduce-scatters, and SP one all-gather more on the wire.
    assert ops["all_gather"] == ops["reduce_scatter"] + m * bsh
    assert wire(sp) == pytest.approx(wire(plain) + m * RING_MOVED["all_gather"](t) * 2 * bsh)


@pytest.mark.parametrize("p,v", [(2, 1), (4, 1), (4, 2)])
def test_pipeline_one_message_per_boundary_each_way(p, v):
    m = 4
    layout = Layout(dp=1, micro_batch=2, grad_accum=m, pp=p, schedule="interleaved" if v > 1 else "1f1b",
                    virtual_stages=v, precision="bf16")
    bsh = 2 * SPEC.seq_len * SPEC.d_model
    sends = [_ops(layout, "pp", stage).get("send", 0) for stage in range(p)]
    recvs = [_ops(layout, "pp", stage).get("recv", 0) for stage in range(p)]
    boundaries = p * v - 1
    assert sum(sends) == sum(recvs) == 2 * m * boundaries * bsh  # activations forward, gradients backward
    if v == 1:
        assert sends[0] == sends[-1] == m * bsh and all(s == 2 * m * bsh for s in sends[1:-1])


def test_context_parallel_ring_exchanges():
    cp, m = 4, 2
    layout = Layout(dp=1, micro_batch=2, grad_accum=m, cp=cp, precision="bf16")
    block = 2 * (SPEC.seq_len // cp) * SPEC.d_model
    ops = _ops(layout, "cp", kinds=("cp",))  # the gradient all-reduce runs on this axis too (dp = 1)
    per_layer = (cp - 1) * block * (2 + 4)  # K, V forward; K, V, dK, dV backward
    assert ops == {"send": m * SPEC.n_layer * per_layer, "recv": m * SPEC.n_layer * per_layer}


def test_gradients_reduce_over_dp_and_cp_and_shards_follow_the_stage():
    layout = Layout(dp=2, micro_batch=1, grad_accum=2, pp=2, cp=2, tp=2, zero_stage=1, schedule="1f1b",
                    precision="bf16")
    comm = predict_comm(SPEC, layout, stage=1)
    padded = -(-rank_params(SPEC, layout, 1) // 4) * 4
    assert comm["dp_cp"]["reduce_scatter"]["elements"] == padded
    assert comm["world"]["all_reduce"] == SCALAR  # the squared gradient norm, summed once over every rank


@pytest.mark.parametrize("layout,axes,name", [
    (Layout(dp=2, micro_batch=1, grad_accum=1), ("dp_cp",), "dp"),
    (Layout(dp=1, cp=2, micro_batch=1, grad_accum=1), ("dp_cp",), "cp"),
    (Layout(dp=2, cp=2, micro_batch=1, grad_accum=1), ("dp_cp",), "dp_cp"),
    (Layout(dp=2, tp=2, micro_batch=1, grad_accum=1), ("dp_cp", "tp"), "dp_cp_tp"),
    (Layout(dp=1, micro_batch=1, grad_accum=1), ("dp_cp",), None),
    (Layout(dp=2, micro_batch=1, grad_accum=1), ("world",), "world"),
])
def test_axis_names_follow_build_mesh(layout, axes, name):
    assert layout.dims.axis_name(axes) == name
