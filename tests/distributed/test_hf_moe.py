"""Hugging Face mixture-of-experts models (Mixtral; Qwen2-MoE with its gated shared expert; Qwen3-MoE) in
every layout, expert parallelism included, against the transformers model trained in one process by its own
eager forward.

paratrain routes the experts modules through its own dropless dispatch and batched matmuls (`hf/moe.py`);
the first tests hold that implementation to transformers' eager loop directly, forward and gradients. The
4-rank matrix then trains dp4, ZeRO-1/3, dp2·tp2 (with and without sequence parallelism, MoE blocks whole on
every tp rank), dp2·pp2, dp2·cp2 and ep2/ep4 alone and with ZeRO-3, tp and pp, in one `World.run`.
"""

from __future__ import annotations

import copy
import functools
import json
import time

import pytest
import torch
import torch.distributed as dist

from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import STABLE_EPS, corpus_windows, hf_loss, hf_param_groups, import_or_skip, tiny_hf
from tests.distributed.test_hybrid import layout

transformers = import_or_skip("transformers")

STEPS = 4
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def with_ep(ep: int, **parts) -> dict:
    """A test_hybrid layout with `ep` of its dp ranks holding different experts; AdamW eps STABLE_EPS: the
    routers have gradient elements of ~1e-9 whose first Adam step is sign(g)·lr (tests.cases says why)."""
    cfg = {**layout(**parts), "expert_parallel": {"size": ep}}
    cfg["optimizer"]["params"]["eps"] = STABLE_EPS
    return cfg


MIXTRAL_4 = [with_ep(1, dp=4), with_ep(1, dp=4, zero=1), with_ep(1, dp=4, zero=3, micro_batch=1),
             with_ep(1, dp=2, tp=2), with_ep(1, dp=2, tp=2, sp=True), with_ep(1, dp=2, pp=2), with_ep(1, dp=2, cp=2),
             with_ep(2, dp=4), with_ep(4, dp=4), with_ep(2, dp=4, zero=3, micro_batch=1), with_ep(2, dp=2, tp=2),
             with_ep(2, dp=2, pp=2), with_ep(2, dp=2, cp=2, ckpt="full")]  # recomputation redoes the all-to-alls
QWEN_4 = [with_ep(1, dp=2, tp=2, sp=True), with_ep(2, dp=4), with_ep(2, dp=2, tp=2, sp=True),
          with_ep(2, dp=2, pp=2)]
MATRIX_4 = [("mixtral", cfg) for cfg in MIXTRAL_4] + [("qwen2_moe", cfg) for cfg in QWEN_4] + \
    [("qwen3_moe", with_ep(2, dp=2, pp=2))]  # q/k norms per head, no shared expert (its tp plan: not yet)


def _loss_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_paratrain_experts_compute_what_transformers_eager_experts_compute(family):
    from paratrain.models.hf.moe import EXPERTS_NAME, install_experts

    eager = tiny_hf(family)
    ours = copy.deepcopy(eager)
    assert install_experts(ours) and ours.config._experts_implementation == EXPERTS_NAME
    assert eager.config._experts_implementation == "eager"
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    expected_loss, expected = _loss_and_grads(eager, ids)
    loss, grads = _loss_and_grads(ours, ids)
    assert torch.allclose(loss, expected_loss, rtol=1e-6, atol=0)
    for name, g in expected.items():  # every parameter, the routers' and experts' included
        assert torch.allclose(grads[name], g, rtol=0, atol=1e-5 * float(g.abs().max())), name


def test_the_view_routes_experts_only_for_models_that_have_them():
    from paratrain.models import HFCausalLM

    assert HFCausalLM(tiny_hf("mixtral")).config._experts_implementation == "paratrain"
    assert HFCausalLM(tiny_hf("llama")).config._experts_implementation != "paratrain"


@pytest.mark.parametrize("source", ["config", "names"])
@pytest.mark.parametrize("dense", [0, 1])
def test_moe_blocks_stay_whole_in_the_tp_plan_and_dense_layers_keep_theirs(source, dense):
    """Qwen2-MoE with one dense layer (`mlp_only_layers`), the plan from its config or from the name rules."""
    from paratrain.model_spec import spec_for
    from paratrain.models import HFCausalLM
    from paratrain.parallel.tp.plan import resolve_plan

    view = HFCausalLM(tiny_hf("qwen2_moe", mlp_only_layers=[dense]))
    if source == "names":
        view.config.base_model_tp_plan = None
    moe = 1 - dense
    plan = spec_for(view).tp_plan(view)
    assert plan[f"model.layers.{moe}.mlp"] == "sequence"
    assert plan[f"model.layers.{dense}.mlp.gate_proj"] == "colwise"
    assert plan[f"model.layers.{dense}.mlp.down_proj"] == "rowwise"
    assert not any("experts" in k or "layers.*.mlp" in k for k in plan), plan  # the config's expert entries
    resolved = resolve_plan(view, None, 2, True)
    assert resolved[f"model.layers.{dense}.mlp"] == "region_input"
    assert not any(k.startswith(f"model.layers.{moe}.mlp.") for k in resolved)  # router, experts, shared expert


@pytest.mark.parametrize("setting, value", [("output_router_logits", True), ("router_jitter_noise", 0.1)])
def test_layout_dependent_router_settings_are_refused_by_name(world1, setting, value):
    world1.run(_refused, setting, value)


def _refused(setting: str, value) -> None:
    from paratrain.api import initialize
    from paratrain.config import ConfigError

    model = tiny_hf("mixtral", **{setting: value})
    with pytest.raises(ConfigError, match=rf"{setting} = {value}.*set model\.config\.{setting} = "):
        initialize(model=model, config=with_ep(1, dp=1, micro_batch=1))


def _local_experts(engine) -> dict:
    """How many experts each experts module of this rank computes (expert parallelism's ExpertGroup.local)."""
    from paratrain.models.hf.moe import is_hf_experts

    groups = [getattr(m, "expert_parallel", None) for m in engine.module.modules() if is_hf_experts(m)]
    return {"local": sorted({4 if group is None else group.local for group in groups})}


def _run(matrix: list[tuple[str, dict]]) -> list:
    runs = []
    for family, cfg in matrix:
        start = time.perf_counter()
        run = run_layout(cfg, functools.partial(tiny_hf, family), corpus_windows(), STEPS,
                         keep_state=dist.get_rank() == 0, model_parameters=hf_param_groups, inspect=_local_experts)
        run.extra["seconds"] = time.perf_counter() - start
        runs.append(run)
    return runs


def test_every_layout_with_expert_parallelism_4_ranks(world4):
    per_rank = world4.run(_run, MATRIX_4)
    refs, lines = {}, []
    for i, (family, cfg) in enumerate(MATRIX_4):
        run = per_rank[0][i]
        if family not in refs:  # every case has the same global batch and optimizer: one reference each
            refs[family] = reference_run(functools.partial(tiny_hf, family), reference_config(cfg, run),
                                         corpus_windows(), STEPS, loss_of=hf_loss, param_groups=hf_param_groups)
        summary = summarize(compare(run, refs[family]))
        assert summary["passed"], (family, run.case, summary)
        assert all(other[i].losses == run.losses for other in per_rank[1:]), (family, run.case)
        assert run.extra["local"] == [4 // cfg["expert_parallel"]["size"]], (family, run.case, run.extra)
        lines.append(f"{family} {run.case}: loss {summary['loss_err']:.1e} param {summary['param_err']:.1e} "
                     f"({run.extra['seconds']:.1f}s)")
    print("\n".join(lines))


def _train_save_and_load(out: str) -> tuple | None:
    """ep2 ZeRO-3: two steps, save_pretrained; then the directory back in at ep4 (each rank reads its expert)."""
    import paratrain
    from paratrain.api import initialize

    model = tiny_hf("mixtral")
    engine, *_ = initialize(model=model, config=with_ep(2, dp=4, zero=3, micro_batch=1),
                            training_data=corpus_windows(), model_parameters=hf_param_groups(model))
    for _ in range(2):
        engine.train_batch()
    engine.save_pretrained(out)
    state = engine.full_state_dict()
    engine.destroy()
    engine, *_ = paratrain.from_pretrained(out, config=with_ep(4, dp=4), training_data=corpus_windows())
    local = engine.module.get_parameter("model.layers.0.mlp.experts.gate_up_proj").shape[0]
    loaded = engine.full_state_dict()
    engine.destroy()
    return (state, loaded, local) if dist.get_rank() == 0 else None


def test_save_pretrained_of_an_ep2_run_loads_into_transformers(world4, tmp_path):
    state, reloaded, local = world4.run(_train_save_and_load, str(tmp_path))[0]
    assert local == 1 and set(reloaded) == set(state)  # in again at ep4: one expert per rank, the same tensors
    assert all(torch.equal(reloaded[k], state[k]) for k in state)
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 32)  # all E experts, HF's names
    config = json.loads((tmp_path / "config.json").read_text())
    assert "paratrain" not in json.dumps(config)  # neither the experts nor the attention registry key
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path)
    loaded = back.state_dict()
    assert set(loaded) == set(state)
    for name, value in loaded.items():
        assert torch.equal(value, state[name]), name
    untrained = tiny_hf("mixtral").state_dict()
    name = "model.layers.1.mlp.experts.down_proj"
    assert not torch.equal(state[name], untrained[name])  # the steps trained the experts
