"""Pipeline parallelism composed with ZeRO-1/2 on the dp axis and with tensor parallelism, against the reference."""

from __future__ import annotations

import pytest

import paratrain
from paratrain.config import ConfigError
from paratrain.testing import max_rel_diff, rel_diff
from paratrain.testing.reference import reference_run
from tests.cases import adamw_config, corpus_windows, tiny_gpt

STEPS = 5


def _model():
    return tiny_gpt(n_layer=4)


def _compose(schedule: str, dp: int, tp: int, stage: int, sp: bool = False) -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4,
                       pipeline={"stages": 4 // (dp * tp), "schedule": schedule, "partition": "uniform"},
                       tensor_parallel={"size": tp, "sequence_parallel": sp}, zero_optimization={"stage": stage})
    data = corpus_windows()
    engine, *_ = paratrain.initialize(model=_model(), config=cfg, training_data=data)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(float(engine.train_batch()))
        norms.append(engine.get_global_grad_norm())
    ref = reference_run(_model, {**cfg, "train_batch_size": engine.train_batch_size()}, data, STEPS)
    param_err, where = max_rel_diff(engine.full_state_dict(), ref.state)
    return {"case": f"{engine.pmesh.dims.describe()} {schedule} zero{stage} sp={sp}",
            "loss_err": max(rel_diff(a, b) for a, b in zip(losses, ref.losses)),
            "norm_err": max(rel_diff(a, b) for a, b in zip(norms, ref.grad_norms)),
            "param_err": param_err, "where": where}


def _cases(cases):
    return [_compose(*c) for c in cases]


def test_dp2_pp2_with_zero_1_and_2_and_pp2_tp2(world4):
    cases = [("1f1b", 2, 1, 1), ("zb-h1", 2, 1, 1), ("gpipe", 2, 1, 2), ("1f1b", 1, 2, 0), ("zb-h1", 1, 2, 1, True)]
    per_rank = world4.run(_cases, cases)
    for ranks in zip(*per_rank):
        for r in ranks:
            assert r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, r


def test_zero3_with_pipeline_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="zero_optimization.stage 3 with pipeline.stages > 1 is not supported"):
        paratrain.resolve_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                  "pipeline": {"stages": 2}, "zero_optimization": {"stage": 3}}, 2)
