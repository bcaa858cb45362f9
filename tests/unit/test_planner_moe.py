"""The planner's mixture-of-experts model: total/active counts, expert states over edp, the ep all-to-all,
ep in the search and the report. Pure functions, one process."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from paratrain.models.llama_moe.model import llama_moe_config
from paratrain.planner import Hardware, Layout, SearchSpace, estimate_memory, estimate_time, model_shape, plan
from paratrain.planner.cli import add_plan_arguments, run_plan
from paratrain.planner.comm import predict_comm, routing_transfer
from paratrain.planner.enumerate import enumerate_layouts, invalid_reason
from paratrain.planner.hardware import collective_seconds
from paratrain.planner.memory import expert_state_bytes, rank_params
from paratrain.planner.model_shape import shape_from_config
from paratrain.planner.moe import (
    all_to_all_elements,
    dense_blocks,
    moe_blocks,
    rank_expert_params,
)
from paratrain.planner.states import model_state_bytes

MIXTRAL = model_shape("mixtral-8x7b")
H, D_EXPERT, LAYERS, SEQ = 4096, 14336, 32, 4096
EXPERT = 3 * H * D_EXPERT  # one routed SwiGLU expert: gate, up, down


def test_mixtral_counts_total_and_active_parameters():
    assert f"{MIXTRAL.params / 1e9:.2f}B" == "46.70B" and f"{MIXTRAL.active_params / 1e9:.2f}B" == "12.88B"
    assert "46.70B parameters (12.88B active)" in MIXTRAL.describe()
    cfg = MIXTRAL.config
    assert (MIXTRAL.params, MIXTRAL.active_params) == (cfg.num_params(), cfg.active_params())
    assert MIXTRAL.flops_per_token == cfg.flops_per_token()  # 6 per *active* matmul parameter
    # the planner's split: dense part + routed experts of each block + embeddings and head
    blocks = LAYERS * (MIXTRAL.moe_block_params() + MIXTRAL.expert_block_params())
    assert blocks + MIXTRAL.embed_params() + MIXTRAL.head_params() == MIXTRAL.params
    assert MIXTRAL.expert_block_params(ep=8) == EXPERT


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny", "deepseek-v3-shape"])
def test_every_moe_preset_adds_up(name):
    spec = model_shape(name)
    layout = Layout(dp=1, micro_batch=1, grad_accum=1)
    total = rank_params(spec, layout, 0) + rank_expert_params(spec, layout, 0)
    assert total == spec.params
    assert dense_blocks(spec, layout, 0) == spec.config.n_dense_layers
    assert shape_from_config(llama_moe_config(name), name).params == spec.params


def test_dense_blocks_follow_the_pipeline_split():
    spec = model_shape("deepseek-v3-shape")  # 61 blocks, the first 3 dense
    layout = Layout(dp=1, micro_batch=1, grad_accum=8, pp=4, schedule="1f1b")
    assert [dense_blocks(spec, layout, s) for s in range(4)] == [3, 0, 0, 0]
    assert [moe_blocks(spec, layout, s) for s in range(4)] == [13, 15, 15, 15]


@pytest.mark.parametrize(("ep", "dp", "zero", "by_hand"), [
    (8, 16, 1, lambda psi, n: 4 * psi + 12 * psi // n),  # bf16 ZeRO-1: 2 + 2 replicated, fp32 master + Adam /N
    (8, 16, 0, lambda psi, n: 16 * psi),
    (8, 16, 2, lambda psi, n: 2 * psi + 16 * psi // n),
    (4, 16, 3, lambda psi, n: 16 * psi // n),
    (8, 8, 1, lambda psi, n: 16 * psi),  # ep = dp x cp: edp = 1, nothing to shard
])
def test_expert_state_per_rank_is_expert_params_over_ep_sharded_over_edp(ep, dp, zero, by_hand):
    layout = Layout(dp=dp, micro_batch=1, grad_accum=1, zero_stage=zero, ep=ep)
    psi = LAYERS * (8 // ep) * EXPERT  # E/ep experts of every MoE block
    edp = dp // ep
    assert layout.expert_shard_group == edp and rank_expert_params(MIXTRAL, layout, 0) == psi
    assert expert_state_bytes(MIXTRAL, layout, 0).total == by_hand(psi, edp)
    # the totals hold the dense states over dp x cp plus the experts' over edp
    dense = model_state_bytes(rank_params(MIXTRAL, layout, 0), dp, zero, "bf16").total
    memory = estimate_memory(MIXTRAL, layout)
    assert memory.params + memory.grads + memory.optimizer_state == dense + by_hand(psi, edp)
    assert memory.experts == by_hand(psi, edp)


def test_all_to_all_volume_is_the_formula():
    mb, m, ep = 2, 4, 8
    layout = Layout(dp=16, micro_batch=mb, grad_accum=m, ep=ep, zero_stage=1)
    tokens_per_rank = mb * SEQ * m
    want = 4 * (ep - 1) * tokens_per_rank * 2 * H * LAYERS // ep  # 4 (ep-1)/ep T k d n_moe
    assert all_to_all_elements(MIXTRAL, layout, 0) == want
    counts = m * LAYERS * (8 - 8 // ep)  # the forward's int64 per-expert counts, (ep-1)/ep of E
    got = predict_comm(MIXTRAL, layout)["ep"]["all_to_all"]
    assert got == {"elements": want + counts, "bytes": 2 * want + 8 * counts}
    # cp splits the sequence, sequence parallelism the tokens over tp, full recompute repeats the forward's
    cp_sp = Layout(dp=8, cp=2, tp=2, sequence_parallel=True, micro_batch=mb, grad_accum=m, ep=ep)
    assert all_to_all_elements(MIXTRAL, cp_sp, 0) == want // 4
    full = Layout(dp=16, micro_batch=mb, grad_accum=m, ep=ep, recompute="full")
    assert all_to_all_elements(MIXTRAL, full, 0) == want * 6 // 4
    assert all_to_all_elements(MIXTRAL, Layout(dp=16, micro_batch=mb, grad_accum=m), 0) == 0


def test_expert_gradients_over_edp_and_dense_ones_over_dp():
    layout = Layout(dp=16, micro_batch=1, grad_accum=2, ep=8, zero_stage=1)
    comm = predict_comm(MIXTRAL, layout)
    dense, experts = rank_params(MIXTRAL, layout, 0), LAYERS * EXPERT
    assert comm["dp"]["reduce_scatter"]["elements"] == -(-dense // 16) * 16
    assert comm["edp"] == {"reduce_scatter": {"elements": experts, "bytes": 2 * experts},
                           "all_gather": {"elements": experts, "bytes": 2 * experts}}
    # ep = 1: the experts are ordinary data-parallel parameters (no edp sub-axis)
    plain_layout = Layout(dp=16, micro_batch=1, grad_accum=2, zero_stage=0)
    plain = predict_comm(MIXTRAL, plain_layout)
    assert "edp" not in plain and "ep" not in plain
    # + the step's loss sum and count; a reporting step adds each MoE block's routing totals (E counts, 4 more)
    assert plain["dp"]["all_reduce"]["elements"] == MIXTRAL.params + 2
    assert routing_transfer(MIXTRAL, plain_layout).elements == LAYERS * (MIXTRAL.num_experts + 4)


def test_expert_groups_wires_and_time():
    hw = Hardware()
    layout = Layout(dp=16, micro_batch=1, grad_accum=2, ep=8, zero_stage=1)
    a2a = predict_comm(MIXTRAL, layout)["ep"]["all_to_all"]["bytes"]
    calls = 2 * 4 * LAYERS + 2 * LAYERS  # rows: 4 per block and micro-batch; counts: 1
    seconds = collective_seconds("all_to_all", a2a, 8, hw.intra_node_bandwidth, hw.latency, calls)
    assert estimate_time(MIXTRAL, layout, hw).comm["ep"] == pytest.approx(seconds)


def test_the_search_enumerates_ep_only_where_it_is_valid():
    assert invalid_reason(MIXTRAL, Layout(dp=12, micro_batch=1, grad_accum=1, ep=8), 8) is not None
    assert "8 experts" in invalid_reason(MIXTRAL, Layout(dp=32, micro_batch=1, grad_accum=1, ep=16), 8)
    dense = model_shape("llama3-8b")
    assert "mixture-of-experts" in invalid_reason(dense, Layout(dp=8, micro_batch=1, grad_accum=1, ep=2), 8)
    space = SearchSpace(schedules=("1f1b",), recompute=("none",), cp_methods=("ring",), zero_stages=(1,))
    eps = {layout.ep for layout in enumerate_layouts(MIXTRAL, 64, 256, 8, space)}
    assert eps == {1, 2, 4, 8}
    assert {layout.ep for layout in enumerate_layouts(dense, 64, 256, 8, space)} == {1}


def test_ep_lets_mixtral_run_data_parallel_on_64_gpus():
    hw = Hardware()
    # pure data parallelism with ZeRO-2: the replicated 16-bit experts do not fit unless ep splits them
    for ep, fits in ((1, False), (8, True)):
        layout = Layout(dp=64, micro_batch=1, grad_accum=4, zero_stage=2, ep=ep)
        assert (estimate_memory(MIXTRAL, layout).total <= hw.usable_memory) is fits
    space = SearchSpace(schedules=("1f1b",), recompute=("none",), cp_methods=("ring",), zero_stages=(2,))
    best = plan(MIXTRAL, 64, 256, hw, space).ranked[0]
    no_ep = plan(MIXTRAL, 64, 256, hw, dataclasses.replace(space, expert_parallel=(1,))).ranked
    assert best.layout.ep > 1 and best.time.total < no_ep[0].time.total
    assert all(e.layout.tp * e.layout.pp > 1 for e in no_ep)  # without ep only model parallelism fits


def test_the_cli_shows_total_active_and_ep(capsys):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args(["--model", "mixtral-8x7b", "--gpus", "64", "--global-batch", "256", "--ep", "8",
                              "--zero", "1", "--schedules", "1f1b", "--recompute", "none", "--cp-methods", "ring",
                              "--top", "1"])
    assert run_plan(args) == 0
    out = capsys.readouterr().out
    assert "46.70B parameters (12.88B active)" in out and " ep8 " in out and '"expert_parallel": {"size": 8}' in out
    assert "experts" in out.splitlines()[6] and "ep: all_to_all" in out
