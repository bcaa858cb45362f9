"""Activation checkpointing: what it keeps (counted where autograd saves it, against the planner's
Korthikanti formulas) and that recomputation replays the forward's random numbers exactly, tensor
parallelism's per-rank stream included. Parity in every composed layout is in test_hybrid.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

import paratrain
from paratrain.models import GPTConfig
from paratrain.planner.layout import Layout
from paratrain.planner.memory import activation_bytes
from paratrain.planner.model_shape import shape_from_config
from paratrain.testing.parity import run_layout
from tests.cases import TINY, adamw_config, corpus_windows, tiny_gpt
from tests.unit.test_planner_memory import _saved_bytes

GRANULARITIES = ("none", "selective", "full")


def _config(tp: int = 1, sp: bool = False, cp: int = 1, ckpt: str = "none", **extra) -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, tensor_parallel={"size": tp, "sequence_parallel": sp},
                       context_parallel={"size": cp}, **extra)
    if ckpt != "none":
        cfg["activation_checkpointing"] = {"enabled": True, "granularity": ckpt}
    return cfg


# ---- what is kept -------------------------------------------------------------------------------------
def _saved_per_granularity(tp: int, sp: bool, cp: int) -> dict[str, int]:
    """Bytes autograd keeps for backward over one micro-batch's forward, per granularity."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, TINY["seq_len"]), generator=gen)
    out = {}
    for ckpt in GRANULARITIES:
        engine, *_ = paratrain.initialize(model=tiny_gpt(), config=_config(tp, sp, cp, ckpt))
        loss = None

        def forward(engine=engine):
            nonlocal loss
            loss = engine(x, x.roll(-1, 1))

        out[ckpt] = _saved_bytes(forward, engine.module.parameters())
        engine.backward(loss)
        engine.step()
    return out


@pytest.mark.parametrize("tp,sp,cp", [(2, False, 1), (2, True, 1), (1, False, 2)])
def test_kept_activations_are_the_planners_and_shrink_with_granularity(world2, tp, sp, cp):
    spec = shape_from_config(GPTConfig(**TINY), "gpt-tiny")
    for measured in world2.run(_saved_per_granularity, tp, sp, cp):
        assert measured["full"] < measured["selective"] < measured["none"], measured
        for ckpt, got in measured.items():
            layout = Layout(dp=1, tp=tp, cp=cp, sequence_parallel=sp, micro_batch=2, grad_accum=1,
                            precision="fp32", recompute=ckpt)
            assert got == activation_bytes(spec, layout, 0), (ckpt, got, activation_bytes(spec, layout, 0))


# ---- random numbers are replayed ------------------------------------------------------------------------
@contextlib.contextmanager
def _without_stream_replay():
    """Activation checkpointing as if it did not know tensor parallelism's per-rank stream."""
    import paratrain.parallel.recompute as ac

    original = ac._stream_contexts
    ac._stream_contexts = lambda streams: (contextlib.nullcontext(), contextlib.nullcontext())
    try:
        yield
    finally:
        ac._stream_contexts = original


def _dropout_runs(cases: list[tuple]) -> list[dict]:
    out = []
    for tp, sp, ckpt, replay in cases:
        with contextlib.nullcontext() if replay else _without_stream_replay():
            run = run_layout(_config(tp, sp, ckpt=ckpt), lambda: tiny_gpt(dropout=0.2), corpus_windows(), 3)
        out.append({"losses": run.losses, "state": run.final_state})
    return out


def test_recompute_draws_the_forwards_dropout_masks(world2):
    """With dropout everywhere (attention core inside the tp region, residual and MLP dropout in the
    sequence-parallel region, embedding dropout outside), a checkpointed run equals the plain one bit for
    bit; without replaying the per-tp-rank stream it does not."""
    cases = [(1, False, "none", True), (1, False, "full", True), (1, False, "selective", True)]
    for sp in (False, True):
        cases += [(2, sp, "none", True), (2, sp, "full", True), (2, sp, "selective", True), (2, sp, "full", False),
                  (2, sp, "selective", False)]
    results = world2.run(_dropout_runs, cases)[0]
    by_case = dict(zip(cases, results))
    for (tp, sp, ckpt, replay), r in by_case.items():
        plain = by_case[(tp, sp, "none", True)]
        same = r["losses"] == plain["losses"] and all(v.equal(plain["state"][k]) for k, v in r["state"].items())
        assert same == replay, (tp, sp, ckpt, replay, r["losses"], plain["losses"])
