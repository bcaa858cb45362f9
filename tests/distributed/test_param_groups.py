"""A user's param groups kept through every split (issue 41): two AdamW groups (decay and no-decay, their own
lr) and DeepSpeed-style Muon groups (`use_muon` in each group, `param.use_muon` on each tensor, options of their
own), each layout against one process on the same groups: loss, gradient norm per step and weights within 1e-5.

The pipeline layouts take the 4-block GPT as a `PipelineModule` whose `layer_names` are the GPT's own names (the
module's parameters are "1.attn.q.weight", the tensors it is known by "blocks.0.attn.q.weight"): the groups are
written in the first, checkpoints and the reference use the second. Before the fix the engine looked the groups
up by the second, so in pp2 (DDP) no parameter reached the optimizer (loss 8.6e-2 away from one process by step
4) and under ZeRO the layout was refused ("trainable parameter(s) missing from the param groups"). tp2 SP also
runs on a model built on the meta device under ZeRO-3, and ep2 on the Mixtral-like MoE (its expert stacks are
Muon's, one matrix per expert).
"""

from __future__ import annotations

import pytest
from torch import nn

from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import STABLE_EPS, corpus_windows, tiny_gpt

pytestmark = pytest.mark.multiprocess

STEPS = 3
GLOBAL_BATCH = 8
MUON = {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.05, "ns_dtype": "float32",
                                   "adamw": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": STABLE_EPS}}}
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": STABLE_EPS}}
# The pipeline module's tensor-parallel plan, written for its own module names ("1.attn.q").
PIPE_PLAN = {"*.attn": "region_input", "*.attn.[qkv]": "colwise", "*.attn.o": "rowwise", "*.mlp.fc": "colwise",
             "*.mlp.proj": "rowwise"}
HEADS = ("head", "lm_head")
ROUTER = "gate.gate.weight"  # a softmax router on AdamW (see the note in tests/distributed/test_muon.py)


def gpt4() -> nn.Module:
    return tiny_gpt(n_layer=4)


def gpt4_pipeline() -> nn.Module:
    """The same GPT as a PipelineModule known by the GPT's names (its spec's own split, handed in as the model)."""
    from paratrain.models.gpt.spec import gpt_pipeline_module

    return gpt_pipeline_module(gpt4())


def gpt4_on_meta() -> nn.Module:
    """Built on the meta device (deferred initialization): the engine allocates and fills each rank's part."""
    import paratrain

    with paratrain.init_empty():
        return gpt4()


def moe() -> nn.Module:
    from tests.distributed.test_expert_parallel import moe_model

    return moe_model()


def _is_muon(model: nn.Module) -> dict[int, bool]:
    """The hidden matrices and expert stacks: not embeddings, not the output head, not the router."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {id(p): p.dim() >= 2 and id(p) not in embeddings and n.split(".")[-2] not in HEADS
            and not n.endswith(ROUTER) for n, p in model.named_parameters()}


def muon_groups(model: nn.Module) -> list[dict]:
    """As a DeepSpeed 0.19 Muon script passes them: `use_muon` tagged on each tensor and said by each group."""
    muon = _is_muon(model)
    for p in model.parameters():
        p.use_muon = muon[id(p)]
    return [{"params": [p for p in model.parameters() if p.use_muon], "use_muon": True, "lr": 0.015},
            {"params": [p for p in model.parameters() if not p.use_muon], "use_muon": False, "weight_decay": 0.0}]


def decay_groups(model: nn.Module) -> list[dict]:
    """No weight decay and a lower lr for norms and biases."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-3}]


def config(optimizer: dict, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1, zero: int = 0, sp: bool = False,
           schedule: str = "1f1b", plan: dict | None = None) -> dict:
    return {"optimizer": optimizer, "gradient_clipping": 0.5, "seed": 7, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": GLOBAL_BATCH // (2 * dp),
            "tensor_parallel": {"size": tp, "sequence_parallel": sp, **({"plan": plan} if plan else {})},
            "expert_parallel": {"size": ep},
            "pipeline": {"stages": pp, "partition": "uniform", "schedule": schedule},
            "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0}}


def _options(engine) -> list:
    return sorted({(bool(g.get("use_muon", False)), g["lr"], g["weight_decay"]) for g in engine.optimizer.param_groups
                   if g["params"]})


def _parity(cfg: dict, make_model, reference_model, groups) -> dict:
    """The layout on `make_model()` with `groups`, one process on `reference_model()` with the same groups."""
    data = corpus_windows()
    run = run_layout(cfg, make_model, data, STEPS, inspect=lambda e: {"options": _options(e)},
                     model_parameters=groups)
    ref = reference_run(reference_model, reference_config(cfg, run), data, STEPS, param_groups=groups)
    return {"case": f"{run.case} {groups.__name__}", **summarize(compare(run, ref)), "losses": run.losses,
            **run.extra}


def _check(runs: list[list[dict]]) -> None:
    for r in runs[0]:
        print(f"{r['case']}: loss {r['loss_err']:.1e}, grad norm {r['norm_err']:.1e}, weights {r['param_err']:.1e}")
    for r in (r for results in runs for r in results):
        assert r["errors"] == [] and r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
        assert r["losses"][-1] < r["losses"][0], r
        want = [(False, 0.003, 0.0), (True, 0.015, 0.05)] if r["case"].endswith("muon_groups") else \
            [(False, 0.001, 0.0), (False, 0.003, 0.1)]
        assert r["options"] == want, r  # every rank's optimizer holds both groups with their own options


def _world2() -> list[dict]:
    out = []
    for groups in (decay_groups, muon_groups):
        optimizer = MUON if groups is muon_groups else ADAMW
        out.append(_parity(config(optimizer, pp=2), gpt4_pipeline, gpt4, groups))
        out.append(_parity(config(optimizer, pp=2, zero=1, schedule="zb-v"), gpt4_pipeline, gpt4, groups))
        out.append(_parity(config(optimizer, tp=2, sp=True), gpt4, gpt4, groups))
        out.append(_parity(config(optimizer, tp=2, sp=True, zero=3), gpt4_on_meta, gpt4, groups))
        out.append(_parity(config(optimizer, dp=2, ep=2, zero=3), moe, moe, groups))
    return out


def test_param_groups_through_pipeline_tensor_and_expert_parallel(world2):
    runs = world2.run(_world2)
    _check(runs)
    assert [r["case"].rsplit(" ", 1)[0] for r in runs[0][:5]] == ["pp2 1f1b", "pp2 zero1 zb-v", "tp2 sp",
                                                                  "tp2 zero3 sp", "dp2 (ep2 folded in dp x cp) zero3"]


def _world8() -> list[dict]:
    layout = {"dp": 2, "pp": 2, "tp": 2, "plan": PIPE_PLAN}
    return [_parity(config(ADAMW, **layout), gpt4_pipeline, gpt4, decay_groups),
            _parity(config(MUON, zero=1, **layout), gpt4_pipeline, gpt4, muon_groups)]


def test_param_groups_in_dp_pp_tp(world8):
    runs = world8.run(_world8)
    _check(runs)
    assert [r["case"] for r in runs[0]] == ["dp2 x pp2 x tp2 1f1b decay_groups",
                                            "dp2 x pp2 x tp2 zero1 1f1b muon_groups"]

