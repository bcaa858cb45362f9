"""Pipeline parallelism composed with ZeRO-1/2 on the dp axis and with tensor parallelism, against the reference."""

from __future__ import annotations

import pytest

import paratrain
from paratrain.config import ConfigError
from paratrain.testing.parity import layout_parity
from tests.cases import adamw_config, corpus_windows, tiny_gpt

STEPS = 5


def _model():
    return tiny_gpt(n_layer=4)


def _compose(schedule: str, dp: int, tp: int, stage: int, sp: bool = False, cp: int = 1) -> dict:
    """The layout dp x pp x tp x cp on 4 ranks with a ZeRO stage on dp; the summary of its parity run."""
    virtual = 2 if schedule in ("interleaved", "zb-v", "dualpipev") else 1
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4,
                       pipeline={"stages": 4 // (dp * tp * cp), "schedule": schedule, "partition": "uniform",
                                 "virtual_stages": virtual}, context_parallel={"size": cp},
                       tensor_parallel={"size": tp, "sequence_parallel": sp}, zero_optimization={"stage": stage})
    return layout_parity(cfg, _model, corpus_windows(), STEPS)


def _cases(cases):
    return [_compose(*c) for c in cases]


def test_dp2_pp2_with_zero_1_and_2_and_pp2_tp2_and_pp2_cp2(world4):
    cases = [("1f1b", 2, 1, 1), ("zb-h1", 2, 1, 1), ("gpipe", 2, 1, 2), ("1f1b", 1, 2, 0), ("zb-h1", 1, 2, 1, True),
             # the V schedules with ZeRO-1/2 on dp, with tp (and sp), and with cp
             ("zb-v", 2, 1, 1), ("dualpipev", 2, 1, 2), ("zb-v", 1, 2, 1, True), ("dualpipev", 1, 2, 0),
             ("zb-v", 1, 1, 0, False, 2), ("dualpipev", 1, 1, 1, False, 2),
             # ZeRO-2 where one backward reaches part of a rank's parameters (two chunks, or B apart from W)
             ("zb-h1", 2, 1, 2), ("interleaved", 2, 1, 2), ("zb-v", 2, 1, 2)]
    per_rank = world4.run(_cases, cases)
    for ranks in zip(*per_rank):
        for r in ranks:
            assert r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, r


def test_zero3_with_pipeline_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="zero_optimization.stage 3 with pipeline.stages > 1 is not supported"):
        paratrain.resolve_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                  "pipeline": {"stages": 2}, "zero_optimization": {"stage": 3}}, 2)


def _deferred_weight_gradients(schedules: list[str]) -> list[dict]:
    """pp2 x tp2: how many projections of this rank defer their weight gradient to W, and how many dW matmuls
    one step's W actions ran."""
    from torch import nn

    out = []
    for schedule in schedules:
        virtual = 2 if schedule in ("zb-v", "dualpipev") else 1
        cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4,
                           pipeline={"stages": 2, "schedule": schedule, "partition": "uniform",
                                     "virtual_stages": virtual}, tensor_parallel={"size": 2})
        engine, _, loader, _ = paratrain.initialize(model=_model(), config=cfg, training_data=corpus_windows())
        engine.train_batch(loader)
        modules = list(engine.parallel.pipeline.module.modules())
        deferral = engine.parallel.pipeline.deferral
        out.append({"schedule": schedule, "deferred": deferral.count, "computed": deferral.computed,
                    "tp_layers": sum(hasattr(m, "weight_grad_parameters") for m in modules),
                    "linears": sum(isinstance(m, nn.Linear) and m.weight.requires_grad for m in modules)})
        engine.destroy()
    return out


def test_the_zero_bubble_schedules_defer_the_tensor_parallel_layers_weight_gradients(world4):
    per_rank = world4.run(_deferred_weight_gradients, ["zb-h1", "zb-v", "dualpipev", "1f1b"])
    for ranks in per_rank:
        for r in ranks:
            if r["schedule"] == "1f1b":  # no split backward: nothing deferred
                assert r["deferred"] == r["computed"] == 0, r
                continue
            # every projection of the rank's stages, tensor-parallel ones included, waits for W: one dW per
            # projection and micro-batch (4)
            assert r["tp_layers"] > 0 and r["deferred"] == r["tp_layers"] + r["linears"], r
            assert r["computed"] == 4 * r["deferred"], r
