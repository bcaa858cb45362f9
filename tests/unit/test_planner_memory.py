"""Planner, memory: ZeRO model-state formulas, Korthikanti activation formulas, and activations counted
on the real model (every tensor autograd saves for backward)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from paratrain.models.gpt.model import GPT, Block, GPTConfig
from paratrain.planner.layout import Layout
from paratrain.planner.memory import (
    activation_bytes,
    estimate_memory,
    in_flight,
    layer_activations,
    rank_params,
)
from paratrain.planner.model_shape import shape_from_config
from paratrain.planner.states import model_state_bytes
from paratrain.testing.activations import saved_activation_bytes
from paratrain.zero import estimate_memory as zero_estimate_memory

PSI = 1_000_003  # not a multiple of N: shards are padded


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zero_states_fp32_adamw(n):
    shard = -(-PSI // n)
    assert model_state_bytes(PSI, n, 0).total == 16 * PSI
    assert model_state_bytes(PSI, n, 1).total == 8 * PSI + 8 * shard
    assert model_state_bytes(PSI, n, 2).total == 4 * PSI + 12 * shard
    assert model_state_bytes(PSI, n, 3).total == 16 * shard
    assert model_state_bytes(PSI, n, 1).as_dict() == {"params": 4 * PSI, "grads": 4 * PSI,
                                                      "optimizer_state": 8 * shard, "total": 8 * PSI + 8 * shard}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero_states_mixed_precision_k12(precision):
    n = 8
    shard = -(-PSI // n)
    assert model_state_bytes(PSI, n, 0, precision).total == 16 * PSI  # 2 + 2 + 12
    assert model_state_bytes(PSI, n, 1, precision).total == 4 * PSI + 12 * shard
    assert model_state_bytes(PSI, n, 2, precision).total == 2 * PSI + 16 * shard  # the gradient shard is fp32
    assert model_state_bytes(PSI, n, 3, precision).total == 16 * shard


def test_offload_moves_the_optimizer_and_fp32_grads_to_the_host():
    n = 4
    shard = -(-PSI // n)
    states = model_state_bytes(PSI, n, 2, "bf16", offload_optimizer=True)
    assert (states.params, states.grads, states.optimizer_state) == (2 * PSI + 4 * shard, 4 * shard, 8 * shard)
    assert states.host == 16 * shard  # master (4) + moments (8) + the fp32 gradient partition (4)
    assert states.device == 2 * PSI  # only the bf16 parameters stay on the device


# ---- one memory formula: the planner's states are paratrain.zero.estimate_memory's (= engine.memory_stats())
STATE_GRID = [(stage, precision, offload, dp, cp)
              for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16", "fp16") for offload in (False, True)
              for dp, cp in ((1, 1), (2, 1), (8, 1), (2, 2), (4, 2)) if not (offload and stage == 0)]


@pytest.mark.parametrize("stage,precision,offload,dp,cp", STATE_GRID)
def test_planner_model_states_are_the_zero_estimators(stage, precision, offload, dp, cp):
    """The planner's whole path (layout -> rank parameters -> shard group dp x cp -> peak rank) against the one
    estimator, which tests/distributed/test_zero_counts.py holds equal to what the engine measures."""
    spec = shape_from_config(PAPER)
    layout = Layout(dp=dp, cp=cp, micro_batch=1, grad_accum=1, zero_stage=stage, precision=precision,
                    offload_optimizer=offload)
    want = zero_estimate_memory(rank_params(spec, layout, 0), dp * cp, stage, "optimizer" if offload else "none",
                                precision)
    got = estimate_memory(spec, layout)
    assert (got.params, got.grads, got.optimizer_state, got.host) == \
        (want["params"], want["grads"], want["optimizer_state"], want["host"])
    assert got.states == want["device"]
    assert got.total == want["device"] + got.activations + got.transient


def test_bf16_stage2_counts_the_fp32_gradient_shard():
    """The issue's example: Ψ = 1M, N = 8, bf16 stage 2 is 2Ψ + 16Ψ/N = 4.00 MB, not 3.75 MB."""
    psi, n = 1_000_000, 8
    assert model_state_bytes(psi, n, 2, "bf16").total == zero_estimate_memory(psi, n, 2, precision="bf16")["total"]
    assert model_state_bytes(psi, n, 2, "bf16").total == 4_000_000
    assert model_state_bytes(psi, n, 2, "bf16").grads == 4 * psi // n


# ---- activations: the paper's formulas --------------------------------------------------------------------
PAPER = GPTConfig(vocab_size=512, seq_len=256, n_layer=4, n_head=8, d_model=128, dropout=0.1)  # d_ff = 4h


def _per_layer(layout: Layout, recompute: str = "none", flash: bool = False) -> float:
    parts = layer_activations(shape_from_config(PAPER), layout, recompute, flash_attention=flash,
                              regather_sequence=True)  # Megatron's sequence parallelism, as in the paper
    return sum(v for k, v in parts.items() if k != "norm_stats")  # the paper leaves out the norm statistics


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_korthikanti_activation_formulas(b, t):
    s, h, a = PAPER.seq_len, PAPER.d_model, PAPER.n_head
    base = Layout(dp=1, micro_batch=b, grad_accum=1, tp=t, precision="bf16")
    sp = replace(base, sequence_parallel=t > 1)
    assert _per_layer(base) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))  # Table 2
    assert _per_layer(sp) == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    assert _per_layer(sp, "selective") == pytest.approx(34 * s * b * h / t)
    assert _per_layer(base, "full") == pytest.approx(2 * s * b * h)
    assert _per_layer(sp, "full") == pytest.approx(2 * s * b * h / t)
    if t == 1:
        assert _per_layer(base) == pytest.approx(s * b * h * (34 + 5 * a * s / h))


def test_in_flight_micro_batches_per_schedule():
    def layout(schedule, p, m, v=1):
        return Layout(dp=1, micro_batch=1, grad_accum=m, pp=p, schedule=schedule, virtual_stages=v)

    assert [in_flight(layout("gpipe", 4, 8), s) for s in range(4)] == [8] * 4
    assert [in_flight(layout("1f1b", 4, 8), s) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(layout("1f1b", 4, 2), s) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight(layout("zb-h1", 4, 8), s) for s in range(4)] == [4, 3, 2, 1]
    for p, v in [(4, 2), (8, 4), (2, 2)]:  # Korthikanti et al. 4.2.3: p (1 + (p - 1)/(p v)) for stage 0
        assert in_flight(layout("interleaved", p, 4 * p, v), 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    # The V schedules: what the validator's simulation holds at its peak, in whole stages (2 chunks each).
    from paratrain.parallel.pp.schedules import build_schedule
    from paratrain.parallel.pp.validate import simulate

    for name, p, m in [("zb-v", 2, 4), ("zb-v", 4, 8), ("zb-v", 4, 16), ("dualpipev", 2, 4), ("dualpipev", 4, 8)]:
        peak = simulate(build_schedule(name, p, m, 2)).peak_in_flight
        assert [in_flight(layout(name, p, m, 2), s) for s in range(p)] == [max(peak) / 2] * p


# ---- activations: counted on the real model ---------------------------------------------------------------
_saved_bytes = saved_activation_bytes  # (run, params) -> bytes autograd keeps, parameters excluded


@pytest.mark.parametrize("b,d_ff", [(1, 0), (3, 96)])
def test_predicted_activations_equal_what_autograd_saves(b, d_ff):
    # fp32: CPU layer norm keeps its statistics in the input dtype, CUDA in fp32 (what the formula assumes).
    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=3, n_head=4, d_model=64, d_ff=d_ff, bias=False)
    spec = shape_from_config(cfg)
    layout = Layout(dp=1, micro_batch=b, grad_accum=1, precision="fp32")
    torch.manual_seed(0)
    block = Block(cfg)
    x = torch.randn(b, cfg.seq_len, cfg.d_model, requires_grad=True)
    assert _saved_bytes(lambda: block(x), block.parameters()) == sum(layer_activations(spec, layout).values())
    model = GPT(cfg)
    idx, targets = torch.randint(0, 256, (b, cfg.seq_len)), torch.randint(0, 256, (b, cfg.seq_len))
    assert _saved_bytes(lambda: model(idx, targets), model.parameters()) == activation_bytes(spec, layout, 0)
