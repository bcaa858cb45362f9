"""The planner checked against reality: for every layout of the calibration matrix, the predicted model-state
bytes equal `engine.memory_stats()` and the predicted communication equals `engine.comm_stats()` (elements and
bytes per axis and collective, every rank, the experts' all-to-alls included), running the config the planner
writes; fp32, bf16, fp16, optimizer offload and expert parallelism among the layouts.

[Note: growing the matrix]
`CALIBRATION` is data: when a strategy lands (ZeRO-1/2/3, mixed precision, TP/SP, PP schedules, CP), add
its layouts here — `Layout(dp=2, ..., zero_stage=2)`, `Layout(dp=1, tp=2, sequence_parallel=True, ...)`,
`Layout(dp=1, pp=2, schedule="1f1b", grad_accum=4, ...)` — with the world size as the fixture to run in. A
failure shows predicted and measured side by side, per rank; fix whichever is wrong (the formula in
paratrain/planner/comm.py or memory.py, or the strategy).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import paratrain
from paratrain.comm import build_mesh
from paratrain.layout.dims import ParallelDims
from paratrain.models import GPTConfig
from paratrain.models.registry import build_model, preset_config
from paratrain.planner.adapters import GPT_TARGETS, LoraPlan
from paratrain.planner.comm import measured_without_calls, predict_comm
from paratrain.planner.layout import Layout
from paratrain.planner.memory import expert_state_bytes, rank_model_states
from paratrain.planner.model_shape import shape_from_config, with_adapters
from paratrain.planner.report import layout_config
from tests.cases import TINY, corpus_windows

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SPEC = shape_from_config(GPTConfig(**TINY), "gpt-tiny")
MOE_SPEC = shape_from_config(preset_config("mixtral-tiny"), "mixtral-tiny")

CALIBRATION = [
    pytest.param(Layout(dp=2, micro_batch=2, grad_accum=1, precision="fp32"), {}, id="ddp-dp2"),
    pytest.param(Layout(dp=2, micro_batch=1, grad_accum=3, precision="fp32"),
                 {"data_parallel": {"bucket_cap_mb": 0.01}}, id="ddp-dp2-accum3-small-buckets"),
    pytest.param(Layout(dp=4, micro_batch=2, grad_accum=2, precision="fp32"), {}, id="ddp-dp4-accum2"),
    pytest.param(Layout(dp=1, cp=2, micro_batch=2, grad_accum=2, precision="fp32"), {}, id="cp2-accum2"),
    pytest.param(Layout(dp=2, cp=2, micro_batch=1, grad_accum=1, precision="fp32"), {}, id="dp2-cp2"),
    pytest.param(Layout(dp=1, cp=2, tp=2, micro_batch=2, grad_accum=1, precision="fp32"), {}, id="tp2-cp2"),
    # Hybrid layouts of the composition matrix, with activation checkpointing (its recomputed forwards
    # communicate again: TP's all-gathers / reduce-scatters under full, the K/V ring under both).
    pytest.param(Layout(dp=2, pp=2, tp=2, zero_stage=1, schedule="1f1b", micro_batch=1, grad_accum=4,
                        sequence_parallel=True, recompute="full", precision="fp32"), {},
                 id="dp2-pp2-tp2-zero1-sp-full"),
    pytest.param(Layout(dp=1, pp=2, cp=2, tp=2, schedule="zb-h1", micro_batch=2, grad_accum=2, recompute="selective",
                        precision="fp32"), {}, id="pp2-cp2-tp2-zbh1-selective"),
    pytest.param(Layout(dp=2, cp=2, tp=2, zero_stage=3, micro_batch=2, grad_accum=1, precision="fp32"),
                 {"zero_optimization": {"stage3_param_persistence_threshold": 0}}, id="dp2-cp2-tp2-zero3"),
    pytest.param(Layout(dp=4, tp=2, zero_stage=2, micro_batch=1, grad_accum=2, recompute="full", precision="fp32"),
                 {}, id="dp4-tp2-zero2-full"),
    # Ulysses (on cp), USP (cp_ring x cp_ulysses), and the V schedules (the bottom of the V sends nothing;
    # ZeRO-2 there reduces once per step, a backward reaching one chunk only).
    pytest.param(Layout(dp=1, cp=2, cp_method="ulysses", micro_batch=2, grad_accum=2, precision="fp32"), {},
                 id="ulysses2-accum2"),
    pytest.param(Layout(dp=1, cp=2, tp=2, cp_method="ulysses", micro_batch=2, grad_accum=1, recompute="selective",
                        precision="fp32"), {}, id="tp2-ulysses2-selective"),
    pytest.param(Layout(dp=1, cp=4, cp_method="usp", ulysses_size=2, micro_batch=1, grad_accum=2, precision="fp32"),
                 {}, id="usp-ring2-ulysses2"),
    pytest.param(Layout(dp=1, pp=2, schedule="zb-v", virtual_stages=2, micro_batch=2, grad_accum=4, precision="fp32"),
                 {}, id="pp2-zbv"),
    pytest.param(Layout(dp=2, pp=2, schedule="dualpipev", virtual_stages=2, zero_stage=2, micro_batch=1, grad_accum=4,
                        precision="fp32"), {}, id="dp2-pp2-dualpipev-zero2"),
    # Mixed precision and optimizer offload: 2-byte parameters and gradients, fp32 masters (and fp16's scaler
    # flags); the optimizer state on the host, counted where it lives.
    pytest.param(Layout(dp=2, zero_stage=1, micro_batch=2, grad_accum=2, precision="bf16"), {}, id="dp2-zero1-bf16"),
    pytest.param(Layout(dp=4, zero_stage=2, micro_batch=1, grad_accum=2, precision="fp16"), {}, id="dp4-zero2-fp16"),
    pytest.param(Layout(dp=2, tp=2, zero_stage=3, offload_optimizer=True, micro_batch=2, grad_accum=1,
                        precision="bf16"), {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
                 id="dp2-tp2-zero3-offload-bf16"),
    # Expert parallelism: the experts' state over the expert-data-parallel group, their all-to-alls on ep.
    pytest.param(Layout(dp=4, ep=2, zero_stage=1, micro_batch=1, grad_accum=2, precision="fp32"), {},
                 id="moe-dp4-ep2-zero1"),
    pytest.param(Layout(dp=2, tp=2, ep=2, micro_batch=2, grad_accum=1, precision="bf16"), {},
                 id="moe-dp2-tp2-ep2-bf16"),
    # Muon: one momentum buffer per matrix element; under ZeRO the gather of the update and the scatter of its
    # orthogonalized shards per flat buffer, over tp the gather of each whole matrix (every rank, under DDP).
    pytest.param(Layout(dp=2, micro_batch=2, grad_accum=1, precision="fp32", optimizer="muon"), {}, id="muon-ddp-dp2"),
    pytest.param(Layout(dp=2, zero_stage=1, micro_batch=2, grad_accum=2, precision="bf16", optimizer="muon"), {},
                 id="muon-dp2-zero1-bf16"),
    pytest.param(Layout(dp=4, zero_stage=2, micro_batch=1, grad_accum=2, precision="fp32", optimizer="muon"), {},
                 id="muon-dp4-zero2"),
    pytest.param(Layout(dp=2, zero_stage=3, micro_batch=2, grad_accum=1, precision="fp32", optimizer="muon"),
                 {"zero_optimization": {"stage3_param_persistence_threshold": 0}}, id="muon-dp2-zero3"),
    pytest.param(Layout(dp=2, tp=2, micro_batch=2, grad_accum=1, sequence_parallel=True, precision="fp32",
                        optimizer="muon"), {}, id="muon-dp2-tp2-sp"),
    pytest.param(Layout(dp=2, pp=2, zero_stage=1, schedule="1f1b", micro_batch=1, grad_accum=4, precision="fp32",
                        optimizer="muon"), {}, id="muon-dp2-pp2-zero1"),
    # HSDP: ZeRO's states over a shard group of 2, the shards' gradients summed over 2 replicas once a step.
    pytest.param(Layout(dp=4, dp_replicate=2, zero_stage=1, micro_batch=1, grad_accum=2, precision="bf16"), {},
                 id="hsdp-r2-zero1-bf16"),
    pytest.param(Layout(dp=4, dp_replicate=2, zero_stage=2, micro_batch=1, grad_accum=2, precision="fp32"), {},
                 id="hsdp-r2-zero2"),
    pytest.param(Layout(dp=2, tp=2, dp_replicate=2, zero_stage=3, micro_batch=2, grad_accum=1, precision="fp32"),
                 {"zero_optimization": {"stage3_param_persistence_threshold": 0}}, id="hsdp-r2-tp2-zero3"),
    pytest.param(Layout(dp=4, dp_replicate=2, ep=2, zero_stage=3, micro_batch=1, grad_accum=2, precision="fp32"),
                 {"zero_optimization": {"stage3_param_persistence_threshold": 0}}, id="moe-hsdp-r2-ep2-zero3"),
]


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@contextlib.contextmanager
def _round_robin_routing():
    """Token i of every rank goes to experts i, i+1, ..., i+k-1 (mod E): the balanced routing the planner's
    all-to-all formula assumes, so the experts' token rows can be compared exactly. The combine weights stay
    the router's scores of those experts (differentiable, as in training). Undone on exit: the worker
    processes of a world are shared by the whole session."""
    from paratrain.moe.router import Router

    original = Router.forward

    def forward(self, x):
        routing = original(self, x)
        tokens = routing.probs.shape[0]
        experts = (torch.arange(tokens)[:, None] + torch.arange(self.top_k)[None, :]) % self.num_experts
        weights = routing.probs.gather(1, experts)
        routing.experts, routing.weights = experts, weights / weights.sum(-1, keepdim=True)
        return routing

    Router.forward = forward
    try:
        yield
    finally:
        Router.forward = original


def _measure(config: dict) -> dict:
    """One optimizer step after a warm-up step (AdamW creates its moments on the first step)."""
    trainer = config["trainer"]
    torch.manual_seed(1)
    model = build_model(trainer["model"], **trainer["model_overrides"])
    data = corpus_windows(seq_len=model.config.seq_len)
    engine, *_ = paratrain.initialize(model=model, config=config, training_data=data)
    with _round_robin_routing():
        engine.train_batch()
        engine.comm_stats(reset=True)
        engine.train_batch()
    return {"coords": engine.mesh.coords, "memory": engine.memory_stats(), "comm": engine.comm_stats()}


@pytest.mark.parametrize("layout,extra", CALIBRATION)
def test_planner_predictions_match_the_engine(request, layout, extra):
    _check(request.getfixturevalue(f"world{layout.world}"), MOE_SPEC if layout.ep > 1 else SPEC, layout, extra)


# Adapters over a frozen base (planner/adapters.py): LoRA on q, v, o, fc, proj of the GPT, DoRA on all six; the
# adapters' states and reductions, the frozen base whole or in ZeRO-3's shards, the adapters' tp collectives.
LORA = with_adapters(SPEC, LoraPlan(4, ("q", "v", "o", "fc", "proj")))
DORA = with_adapters(SPEC, LoraPlan(4, GPT_TARGETS, dora=True))
NO_PERSIST = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
SPEC_64 = shape_from_config(GPTConfig(**{**TINY, "d_model": 64}), "gpt-tiny")
QLORA = with_adapters(SPEC_64, LoraPlan(4, GPT_TARGETS, quantize="nf4"))
QLORA_DOUBLE = with_adapters(SPEC_64, LoraPlan(4, ("q", "v", "fc"), quantize="fp4", double_quant=True))
# d_model 128: tp2 splits o's and proj's inputs into whole blocks of 64 per rank
QLORA_128 = with_adapters(shape_from_config(GPTConfig(**{**TINY, "d_model": 128}), "gpt-tiny"),
                          LoraPlan(4, GPT_TARGETS, quantize="nf4"))
# torchao's NF4 (peft.quantize_backend "torchao"): int8 scales, a factor per 256 blocks; d_model 128 makes every
# projection a multiple of 16384 values
QLORA_TORCHAO = with_adapters(shape_from_config(GPTConfig(**{**TINY, "d_model": 128}), "gpt-tiny"),
                              LoraPlan(4, GPT_TARGETS, quantize="nf4", double_quant=True, backend="torchao"))
ADAPTERS = [
    pytest.param(LORA, Layout(dp=2, micro_batch=2, grad_accum=2, precision="fp32"), {}, id="lora-ddp-dp2"),
    pytest.param(LORA, Layout(dp=4, zero_stage=1, micro_batch=1, grad_accum=2, precision="bf16"), {},
                 id="lora-dp4-zero1-bf16"),
    pytest.param(DORA, Layout(dp=4, zero_stage=2, micro_batch=1, grad_accum=2, precision="fp32"), {},
                 id="dora-dp4-zero2"),
    pytest.param(LORA, Layout(dp=4, zero_stage=3, micro_batch=1, grad_accum=2, precision="fp32"), NO_PERSIST,
                 id="lora-dp4-zero3"),
    pytest.param(DORA, Layout(dp=2, tp=2, zero_stage=3, micro_batch=2, grad_accum=1, sequence_parallel=True,
                              precision="fp32"), NO_PERSIST, id="dora-dp2-tp2-sp-zero3"),
    pytest.param(DORA, Layout(dp=2, tp=2, micro_batch=2, grad_accum=2, recompute="full", precision="fp32"), {},
                 id="dora-dp2-tp2-full"),
    pytest.param(LORA, Layout(dp=2, pp=2, zero_stage=1, schedule="1f1b", micro_batch=1, grad_accum=4,
                              precision="fp32"), {}, id="lora-dp2-pp2-zero1"),
    pytest.param(LORA, Layout(dp=4, dp_replicate=2, zero_stage=3, micro_batch=1, grad_accum=2, precision="fp32"),
                 NO_PERSIST, id="lora-hsdp-r2-zero3"),
    # QLoRA (peft.quantize_base): the adapted bases in 4 bits, packed data and scales (widths of 64: bitsandbytes'
    # blocks)
    pytest.param(QLORA, Layout(dp=2, zero_stage=2, micro_batch=2, grad_accum=1, precision="fp32"), {},
                 id="qlora-nf4-dp2-zero2"),
    pytest.param(QLORA_DOUBLE, Layout(dp=2, micro_batch=2, grad_accum=1, precision="fp32"), {},
                 id="qlora-fp4-double-ddp-dp2"),
    pytest.param(QLORA_128, Layout(dp=2, tp=2, zero_stage=1, micro_batch=2, grad_accum=1, precision="fp32"), {},
                 id="qlora-nf4-dp2-tp2-zero1"),
    pytest.param(QLORA, Layout(dp=4, zero_stage=3, micro_batch=1, grad_accum=2, precision="fp32"), NO_PERSIST,
                 id="qlora-nf4-dp4-zero3"),
    pytest.param(QLORA_DOUBLE, Layout(dp=4, zero_stage=3, micro_batch=1, grad_accum=2, precision="fp32"), NO_PERSIST,
                 id="qlora-fp4-double-dp4-zero3"),
    pytest.param(QLORA_TORCHAO, Layout(dp=4, zero_stage=3, micro_batch=1, grad_accum=2, precision="fp32"), NO_PERSIST,
                 id="qlora-torchao-dp4-zero3"),
    pytest.param(QLORA_TORCHAO, Layout(dp=2, tp=2, zero_stage=3, micro_batch=2, grad_accum=1, precision="fp32"),
                 NO_PERSIST, id="qlora-torchao-dp2-tp2-zero3"),
]


@pytest.mark.parametrize("spec,layout,extra", ADAPTERS)
def test_planner_predictions_match_the_engine_with_adapters(request, spec, layout, extra):
    _check(request.getfixturevalue(f"world{layout.world}"), spec, layout, extra)


def _check(world, spec, layout: Layout, extra: dict) -> None:
    config = _merge(layout_config(spec, layout), extra)
    for rank, got in enumerate(world.run(_measure, config)):
        stage = got["coords"]["pp"]
        dense = rank_model_states(spec, layout, stage).as_dict()
        experts = expert_state_bytes(spec, layout, stage).as_dict()
        for key, predicted in dense.items():
            measured = got["memory"][key]
            assert predicted + experts[key] == measured, \
                f"rank {rank} {key}: predicted {predicted} + {experts[key]} B, measured {measured} B ({got['memory']})"
        predicted, measured = predict_comm(spec, layout, stage), measured_without_calls(got["comm"])
        assert predicted == measured, f"rank {rank}"


def _mesh_axis_names(layouts: list[dict]) -> list[dict]:
    out = []
    for sizes in layouts:
        dims = ParallelDims(4, **sizes)
        mesh = build_mesh(dims)
        out.append({n: mesh.axis(n).name for n in dims.dims if mesh.axis(n).size > 1})
        mesh.destroy()
    return out


MESHES = [dict(dp=2, tp=2), dict(dp=1, pp=2, cp=2), dict(dp=2, cp=2), dict(dp_replicate=2), dict(ep=2),
          dict(dp_replicate=2, ep=2), dict(dp=1, cp=4, cp_ulysses=2)]


def test_planner_axis_names_are_the_meshs(world4):
    """Every named dim's group is counted under the name the rank math gives it (the planner's keys)."""
    for sizes, measured in zip(MESHES, world4.run(_mesh_axis_names, MESHES)[0]):
        dims = ParallelDims(4, **sizes)
        predicted = {n: dims.axis_name(n) for n in dims.dims}
        assert {k: v for k, v in predicted.items() if v is not None} == measured, sizes
