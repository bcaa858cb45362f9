"""Deferred initialization: a model built on the meta device and materialized by the engine, each rank
allocating only its part, has exactly the parameters eager construction with the same seed gives, in every
layout, and then trains as the single-process reference does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.checkpoint import CheckpointError
from paratrain.testing import rel_diff
from paratrain.testing.reference import reference_run
from tests.cases import adamw_config, corpus_windows, tiny_gpt, tiny_llama

STEPS = 3
FAMILIES = {"gpt": tiny_gpt, "llama": tiny_llama}
# The layouts of the issue: ZeRO-3, tp2, pp2, dp2 x tp2 x pp2, dp2 x cp2 ZeRO-3 (world 8 for the product).
LAYOUTS = {
    "dp4 zero3": dict(zero=3),
    "dp2 x tp2": dict(tp=2),
    # the tp sums of a norm's gradient (hooks) must sit on the parameters ZeRO-3 allocates from meta
    "dp2 x tp2 sp zero3": dict(tp=2, sp=True, zero=3),
    "dp2 x pp2": dict(pp=2),
    "dp2 x pp2 x tp2": dict(tp=2, pp=2),
    "dp2 x cp2 zero3": dict(cp=2, zero=3),
    "dp4 zero1": dict(zero=1),
    "dp4 bf16 ddp": dict(precision="bf16"),
}


def _config(tp: int = 1, pp: int = 1, cp: int = 1, zero: int = 0, precision: str = "fp32", sp: bool = False) -> dict:
    cfg = adamw_config(train_batch_size=8, train_micro_batch_size_per_gpu=1,
                       tensor_parallel={"size": tp, "sequence_parallel": sp}, context_parallel={"size": cp},
                       pipeline={"stages": pp, "partition": "parameters"},
                       zero_optimization={"stage": zero, "stage3_param_persistence_threshold": 0})
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def _meta(family: str, how: str):
    def build():
        # "seeded inside": the family's own manual_seed(1) (tiny_gpt, tiny_llama), after init_empty opened
        torch.manual_seed(99 if how == "init_empty, seeded inside" else 1)
        if how.startswith("init_empty"):
            with paratrain.init_empty():
                model = FAMILIES[family]()
            if how == "init_empty, then other draws":  # the recorded state counts, not the one at initialize
                torch.rand(1000)
            return model
        if how == "zero.Init":
            with paratrain.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
                return FAMILIES[family]()
        with torch.device("meta"):
            return FAMILIES[family]()
    return build


def _eager_and_meta(layout: dict, family: str, how: str, world_size: int) -> dict:
    """The same layout built eagerly and on meta: full states (bit-equal?) and the meta run's losses."""
    cfg = _config(**layout)
    eager, *_ = paratrain.initialize(model=FAMILIES[family](), config=cfg, training_data=corpus_windows())
    want = eager.full_state_dict()
    model = _meta(family, how)()
    assert all(p.is_meta for p in model.parameters())
    engine, *_ = paratrain.initialize(model=model, config=cfg, training_data=corpus_windows())
    got = engine.full_state_dict()
    same = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    bad = [k for k in want if k in got and not torch.equal(got[k], want[k])][:3]
    losses = [float(engine.train_batch()) for _ in range(STEPS)]
    for e in (eager, engine):
        e.destroy()
    return {"layout": engine.mesh.dims.describe(), "same": same, "bad": bad, "losses": losses}


def _run(world, family: str, how: str, names: list[str]) -> None:
    results = {}
    for name in names:
        rows = world.run(_eager_and_meta, LAYOUTS[name], family, how, world.world_size)
        results[name] = rows[0]
        for row in rows:
            assert row["same"], (name, row["bad"])
    ref = reference_run(FAMILIES[family], adamw_config(train_batch_size=8), corpus_windows(), STEPS)
    for name, row in results.items():
        if "bf16" in name:
            continue  # bf16 has its own tolerance; what matters here is the bit-equal start above
        assert max(rel_diff(a, b) for a, b in zip(row["losses"], ref.losses)) <= 1e-5, (name, row["losses"])


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_meta_model_equals_eager_in_every_layout_and_trains_like_one_process(world4, family):
    _run(world4, family, "init_empty", ["dp4 zero3", "dp2 x tp2", "dp2 x tp2 sp zero3", "dp2 x pp2",
                                        "dp2 x cp2 zero3", "dp4 zero1", "dp4 bf16 ddp"])


def test_meta_model_in_dp2_tp2_pp2(world8):
    _run(world8, "llama", "init_empty", ["dp2 x pp2 x tp2"])


@pytest.mark.parametrize("how", ["torch.device", "zero.Init", "init_empty, then other draws",
                                 "init_empty, seeded inside"])
def test_bare_meta_device_and_deepspeeds_name_give_the_same_values(world2, how):
    for row in world2.run(_eager_and_meta, dict(zero=3), "gpt", how, 2):
        assert row["same"], row["bad"]


class _Uninitialized(nn.Module):
    """A parameter set by its constructor's factory call, with no reset_parameters(): on the meta device its
    values are lost."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.linear = nn.Linear(4, 4)

    def forward(self, x, y):
        return ((self.linear(x) * self.scale - y) ** 2).mean()


def _uninitialized() -> str:
    with paratrain.init_empty():
        model = _Uninitialized()
    try:
        paratrain.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    except CheckpointError as exc:
        return str(exc)
    return ""


def _with_init_fn() -> list:
    def init_fn(module):
        if isinstance(module, _Uninitialized):
            nn.init.ones_(module.scale)
        elif isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.5)
            nn.init.zeros_(module.bias)

    with paratrain.init_empty():
        model = _Uninitialized()
    engine, *_ = paratrain.initialize(model=model, init_fn=init_fn, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    state = engine.full_state_dict()
    return [state["scale"].tolist(), state["linear.weight"].unique().tolist(), state["linear.bias"].tolist()]


def test_a_tensor_no_initialization_reaches_is_refused_by_name_and_init_fn_fills_it(world2):
    for message in world2.run(_uninitialized):
        assert "1 tensor(s) of the model were never initialized: scale" in message and "init_fn=" in message
    for scale, weight, bias in world2.run(_with_init_fn):
        assert scale == [1.0] * 4 and weight == [0.5] and bias == [0.0] * 4


def test_balanced_partition_is_refused_for_a_meta_model():
    from paratrain.models import gpt_pipeline_module
    from paratrain.parallel.pp.split import PartitionError, choose_boundaries

    with paratrain.init_empty():
        model = tiny_gpt()
    with pytest.raises(PartitionError, match="meta device"):
        choose_boundaries(gpt_pipeline_module(model), "balanced", 2)


def test_zero_init_refuses_what_it_cannot_honour():
    from paratrain.compat.names import DeepSpeedNotSupported

    with pytest.raises(DeepSpeedNotSupported, match=r"zero.Init\(remote_device=...\)"):
        paratrain.zero.Init(remote_device="nvme")
    with paratrain.zero.Init(enabled=False):
        assert not nn.Linear(2, 2).weight.is_meta


def test_the_template_is_the_meta_models_structure_with_tensors_of_its_own():
    """`template_of` copies the module tree and the tensors, shares the rest (configs, hook dicts), and points
    a plain attribute naming a registered tensor at the copy, as a deep copy would."""
    from paratrain.init.empty import RNG_ATTRIBUTE
    from paratrain.init.replay import template_of

    with paratrain.init_empty():
        model = tiny_llama()
    model.head_alias = model.lm_head.weight  # a plain attribute naming a registered tensor
    template = template_of(model)
    assert [n for n, _ in template.named_modules()] == [n for n, _ in model.named_modules()]
    ours, theirs = dict(template.named_parameters()), dict(model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert t is not theirs[name] and t.is_meta
        assert (t.shape, t.dtype) == (theirs[name].shape, theirs[name].dtype)
        assert getattr(t, RNG_ATTRIBUTE) is getattr(theirs[name], RNG_ATTRIBUTE)  # construction's random state
    assert template.head_alias is template.lm_head.weight
    assert template.config is model.config
    kept = template.lm_head.weight
    model.lm_head.weight = nn.Parameter(torch.zeros(1))  # what a strategy does to the model leaves it alone
    assert template.lm_head.weight is kept and kept.shape != (1,)
