"""Planner, communication: per-rank payloads per axis against the formulas of docs/planner.md (communication
per optimizer step)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from paratrain.models.gpt.model import GPTConfig
from paratrain.planner.comm import predict_comm, rank_transfers
from paratrain.planner.hardware import RING_MOVED
from paratrain.planner.layout import Layout, axis_name
from paratrain.planner.memory import rank_params
from paratrain.planner.model_specs import spec_from_config

SPEC = spec_from_config(GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=8, d_model=64, bias=False))
PSI = SPEC.params
SCALAR = {"elements": 1, "bytes": 4}


def _ops(layout: Layout, axis: str, stage: int = 0, kinds=None) -> dict:
    """{op: elements} on `axis`, without the bookkeeping scalars."""
    out: dict[str, int] = {}
    for t in rank_transfers(SPEC, layout, stage):
        if axis_name(layout.sizes, t.axes) == axis and t.kind != "scalar" and (kinds is None or t.kind in kinds):
            out[t.op] = out.get(t.op, 0) + t.elements
    return out


def test_ddp_one_all_reduce_of_psi_plus_the_loss_sum_and_count():
    layout = Layout(dp=4, micro_batch=2, grad_accum=3, precision="fp32")  # the token loss's two fp64 numbers
    assert predict_comm(SPEC, layout) == {"dp": {"all_reduce": {"elements": PSI + 2, "bytes": 4 * PSI + 16}}}


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
    assert comm["pp_tp"]["all_reduce"] == SCALAR


@pytest.mark.parametrize("sizes,axes,name", [
    ({"dp": 2, "pp": 1, "cp": 1, "tp": 1}, ("dp", "cp"), "dp"),
    ({"dp": 1, "pp": 1, "cp": 2, "tp": 1}, ("dp", "cp"), "cp"),
    ({"dp": 2, "pp": 1, "cp": 2, "tp": 1}, ("dp", "cp"), "dp_cp"),
    ({"dp": 2, "pp": 1, "cp": 1, "tp": 2}, ("dp", "cp", "tp"), "dp_cp_tp"),
    ({"dp": 1, "pp": 1, "cp": 1, "tp": 1}, ("dp", "cp"), None),
    ({"dp": 2, "pp": 1, "cp": 1, "tp": 1}, ("dp", "pp", "cp", "tp"), "world"),
])
def test_axis_names_follow_build_mesh(sizes, axes, name):
    assert axis_name(sizes, axes) == name
