"""DeepSpeed's `deepspeed.moe.layer.MoE(ep_size > 1)` through `import paratrain as deepspeed`: training at ep2 (2
and 4 ranks, ZeRO-2 and ZeRO-3 included) against one process, the refusals, `deepspeed.moe.utils`' param
groups, the experts each rank holds and the all-to-all traffic (against real DeepSpeed:
tests/distributed/test_deepspeed_moe_ep_vs_deepspeed.py).

DeepSpeed's gating routes and drops per rank, on the rank's own tokens (its capacity is a fraction of the
rank's micro-batch). So the reference is one process that runs the same global batch as the ranks'
micro-batches, one forward each, averaging their losses (gradient accumulation): each forward routes and
drops exactly what one rank's does. Deterministic gating only (`use_rts=False`, no second-expert sampling,
no noise); AdamW eps 1e-6 (`tests.cases.STABLE_EPS`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import paratrain as deepspeed
from paratrain.data import TokenWindows
from paratrain.errors import Error
from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import STABLE_EPS, adamw_config, import_deepspeed

STEPS = 3
GLOBAL_BATCH = 8
MICRO_BATCH = 2
EXPERTS = 4
D = 16
SEQ_LEN = 16
VOCAB = 64
# capacity factor 1.0 drops (8 rows per expert for top-1 over 32 tokens); drop_tokens=False is dropless
VARIANTS = {"top1 dropping": dict(k=1), "top1 dropless": dict(k=1, drop_tokens=False),
            "top2 dropping": dict(k=2), "top2 dropless": dict(k=2, drop_tokens=False)}


class TinyDeepSpeedMoE(nn.Module):
    """Embedding -> two residual DeepSpeed MoE layers -> head; loss = cross-entropy + 0.01 · Σ l_aux."""

    def __init__(self, ep_size: int, k: int = 1, drop_tokens: bool = True, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.moes = nn.ModuleList(
            deepspeed.moe.layer.MoE(D, nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)),
                                    num_experts=EXPERTS, ep_size=ep_size, k=k, capacity_factor=1.0,
                                    min_capacity=1, drop_tokens=drop_tokens, use_rts=False,
                                    top2_2nd_expert_sampling=False) for _ in range(2))
        self.head = nn.Linear(D, vocab, bias=False)
        with torch.no_grad():  # DeepSpeed's expert copies start equal: make them differ so a mixed-up one shows
            for moe in self.moes:
                for p in moe.deepspeed_moe.experts.parameters():
                    p.add_(0.3 * torch.randn_like(p))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, aux = self.embed(idx), 0.0
        for moe in self.moes:
            out, l_aux, _ = moe(h)
            h, aux = h + out, aux + l_aux
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten()) + 0.01 * aux


def token_windows() -> TokenWindows:
    """64 windows of SEQ_LEN random tokens (seeded): no corpus to load in every rank."""
    tokens = torch.randint(0, VOCAB, (64 * SEQ_LEN + 1,), generator=torch.Generator().manual_seed(5))
    return TokenWindows(tokens, SEQ_LEN)


def make_model(variant: str, ep_size: int = 2) -> TinyDeepSpeedMoE:
    torch.manual_seed(3)
    return TinyDeepSpeedMoE(ep_size, **VARIANTS[variant])


def per_micro_batch_loss(model: nn.Module, batch) -> torch.Tensor:
    """The reference's loss of a global batch: the mean over the ranks' micro-batches (the data-parallel
    sampler gives each micro-step of each rank a consecutive run of MICRO_BATCH samples)."""
    idx, targets = batch
    losses = [model(idx[i:i + MICRO_BATCH], targets[i:i + MICRO_BATCH]) for i in range(0, len(idx), MICRO_BATCH)]
    return torch.stack(losses).mean()


def moe_param_groups(model: nn.Module) -> list[dict]:
    """DeepSpeed's MoE param groups (a 'moe' group of the experts, named 'ep_size_2'), with DeepSpeed's keys."""
    split = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer
    return split({"params": list(model.parameters()), "name": "dense"})


def ds_config(dp: int, zero: int = 0) -> dict:
    """No expert_parallel section: the layers' ep_size sets it. `dp`: ranks drawing different samples."""
    cfg = adamw_config(train_micro_batch_size_per_gpu=MICRO_BATCH,
                       gradient_accumulation_steps=GLOBAL_BATCH // (MICRO_BATCH * dp),
                       zero_optimization={"stage": zero, "stage3_param_persistence_threshold": 0})
    cfg["optimizer"]["params"]["eps"] = STABLE_EPS
    return cfg


def _dropped(engine) -> dict:
    """Whether any rank's last forward had an expert over its capacity (the dropping variants must drop)."""
    over = 0
    for module in engine.module.modules():
        if isinstance(module, deepspeed.moe.layer.MoE):
            gate = module.deepspeed_moe.gate
            capacity = gate._capacity(MICRO_BATCH * SEQ_LEN)
            over += int(capacity is not None and int(module.deepspeed_moe.exp_counts.max()) > capacity)
    return {"over_capacity": over, "ep": engine.mesh.dims.ep}


def _matrix(cases: list[tuple[str, dict, bool]]) -> list:
    """One run per (variant, config, whether the param groups come from deepspeed.moe.utils)."""
    return [run_layout(cfg, lambda v=variant: make_model(v), token_windows(), STEPS, keep_state=dist.get_rank() == 0,
                       inspect=_dropped, model_parameters=moe_param_groups if groups else None)
            for variant, cfg, groups in cases]


def _check_parity(per_rank: list[list], cases: list[tuple[str, dict, bool]]) -> list[str]:
    lines, refs = [], {}
    for i, (variant, cfg, _) in enumerate(cases):
        run = per_rank[0][i]
        assert run.train_batch_size == GLOBAL_BATCH and run.extra["ep"] == 2, run.case
        if variant not in refs:
            refs[variant] = reference_run(lambda v=variant: make_model(v), reference_config(cfg, run),
                                          token_windows(), STEPS, loss_of=per_micro_batch_loss)
        summary = summarize(compare(run, refs[variant]))
        assert summary["passed"], (variant, run.case, summary)
        dropped = sum(ranks[i].extra["over_capacity"] for ranks in per_rank)
        assert (dropped > 0) == variant.endswith("dropping"), (variant, run.case, dropped)
        lines.append(f"{variant} {run.case}: loss {summary['loss_err']:.1e} param {summary['param_err']:.1e}")
    return lines


# every variant without ZeRO at 2 ranks; ZeRO-2/3 and 4 ranks each with a dropping and a dropless variant
CASES_2 = [(variant, ds_config(2), False) for variant in VARIANTS] + [
    ("top1 dropping", ds_config(2, zero=2), True), ("top2 dropless", ds_config(2, zero=2), False),
    ("top2 dropping", ds_config(2, zero=3), True), ("top1 dropless", ds_config(2, zero=3), True)]
CASES_4 = [("top2 dropping", ds_config(4), True), ("top1 dropping", ds_config(4, zero=3), False),
           ("top2 dropless", ds_config(4, zero=3), True)]


@pytest.mark.parametrize("size, cases", [(2, CASES_2), (4, CASES_4)], ids=["2", "4"])
def test_deepspeed_moe_ep2_matches_one_process(request, size, cases):
    """ep2 from the layers' ep_size: at 2 ranks (dp2 folds ep2) with ZeRO 0/2/3, at 4 (dp4: ep2 x edp2) with
    ZeRO 0/3; top-1 and top-2, dropping and dropless; loss, grad norm and parameters within 1e-5."""
    world = request.getfixturevalue(f"world{size}")
    print("\n".join(_check_parity(world.run(_matrix, cases), cases)))


def _experts_traffic_and_size_refusal() -> dict:
    """One ep2 engine: the experts this rank holds, DeepSpeed's marks on them, a step's all-to-all elements;
    then a layer ep_size that does not divide dp x cp."""
    engine, *_ = deepspeed.initialize(model=make_model("top2 dropping"), config=ds_config(2),
                                      training_data=token_windows())
    engine.train_batch()
    engine.comm_stats(reset=True)
    engine.train_batch()
    moved = {tag: engine.mesh.stats.total(tag=tag).elements for tag in ("ep_counts", "ep_dispatch", "ep_combine")}
    layers = [m for m in engine.module.modules() if isinstance(m, deepspeed.moe.layer.MoE)]
    experts = [p for m in layers for p in m.deepspeed_moe.experts.parameters()]
    try:
        deepspeed.initialize(model=make_model("top2 dropping", ep_size=4), config=ds_config(2),
                             training_data=token_windows())
        refusal = None
    except Error as exc:
        refusal = str(exc)
    return {"moved": moved, "held": [p.shape[0] for p in experts],
            "local": [(m.num_local_experts, m.deepspeed_moe.num_local_experts, m.deepspeed_moe.expert_group.first)
                      for m in layers],
            "marks": {(deepspeed.moe.utils.is_moe_param(p), p.group_name) for p in experts},
            "dense_marked": any(deepspeed.moe.utils.is_moe_param(p) for n, p in engine.module.named_parameters()
                                if ".experts." not in n),
            "ep": engine.mesh.dims.ep, "refusal": refusal}


def test_experts_per_rank_traffic_and_an_ep_size_that_does_not_divide_dp(world2):
    per_rank = world2.run(_experts_traffic_and_size_refusal)
    for rank, r in enumerate(per_rank):
        assert r["ep"] == 2
        assert r["held"] == [EXPERTS // 2] * 8  # 2 layers x (2 weights + 2 biases), 2 of 4 experts each
        assert r["local"] == [(2, 2, 2 * rank)] * 2  # rank r holds experts [2r, 2r + 2)
        assert r["marks"] == {(True, "ep_size_2")} and not r["dense_marked"]
        moved = r["moved"]  # dispatch and combine move the same rows (forward and backward), in whole rows
        assert moved["ep_dispatch"] == moved["ep_combine"] > 0 and moved["ep_dispatch"] % D == 0, moved
        assert moved["ep_counts"] > 0
        assert "expert_parallel.size 4 (deepspeed.moe.layer.MoE's ep_size sets it) must divide dp x cp" in \
            r["refusal"], r["refusal"]


def _two_layers(first_ep: int, second_ep: int) -> nn.Module:
    def layer(ep):
        return deepspeed.moe.layer.MoE(D, nn.Linear(D, D), num_experts=EXPERTS, ep_size=ep)
    return nn.Sequential(layer(first_ep), layer(second_ep))


def test_ep_size_refusals_before_any_process_group(monkeypatch):
    import paratrain.api

    def reached(*args, **kwargs):  # the refusals must come first (the suite may already hold a process group)
        raise AssertionError("initialize reached init_distributed before refusing the ep sizes")

    monkeypatch.setattr(paratrain.api, "init_distributed", reached)
    with pytest.raises(Error, match=r"MoE\(num_experts=4, ep_size=3\): ep_size must divide num_experts .* \[1, 2, 4\]"):
        deepspeed.moe.layer.MoE(D, nn.Linear(D, D), num_experts=EXPERTS, ep_size=3)
    # raised by initialize before init_distributed
    with pytest.raises(Error, match=r"different ep_size \(ep_size=1 in \['0'\]; ep_size=2 in \['1'\]\).*one "
                                    r"expert-parallel axis"):
        deepspeed.initialize(model=_two_layers(1, 2), config=ds_config(2))
    with pytest.raises(Error, match=r"'expert_parallel.size' = 4 but .* \(e.g. '0'\) have ep_size=2.*remove "
                                    r"expert_parallel.size"):
        deepspeed.initialize(model=_two_layers(2, 2), config={**ds_config(2), "expert_parallel": {"size": 4}})
    with pytest.raises(Error, match=r"'expert_parallel.size' = 2 but .* have ep_size=1"):
        deepspeed.initialize(model=_two_layers(1, 1), config={**ds_config(2), "expert_parallel": {"size": 2}})
    from paratrain.api import resolve_config
    from paratrain.config import ConfigError
    from paratrain.engine.strategies import strategies_of
    from paratrain.parallel.parallelize import parallelize

    with pytest.raises(ConfigError, match=r"'expert_parallel.size' = 1 but .* ep_size=2: set expert_parallel.size "
                                          r"to 2, or build the engine with paratrain.initialize"):
        parallelize(_two_layers(2, 2), None, strategies_of(resolve_config(ds_config(2), 2)))  # an engine built by hand


def test_split_params_into_moe_groups():
    utils = deepspeed.moe.utils
    model = make_model("top1 dropping")
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    groups = utils.split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "all", "lr": 0.1}], max_group_size=2 * EXPERTS * D * D)
    assert [(g["name"], g.get("moe"), g["lr"]) for g in groups] == [("all", None, 0.1)] + \
        [("ep_size_2", True, 0.1)] * (len(groups) - 1)
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in dense]
    chunks = [g["params"] for g in groups[1:]]
    assert [id(p) for c in chunks for p in c] == [id(p) for p in experts]  # every expert param once, in order
    # runs of at most 2·E·D·D elements: a (4, 32, 16) weight alone, then the bias, weight, bias that fit after it
    assert len(chunks) > 1 and all(sum(p.numel() for p in c) <= 2 * EXPERTS * D * D or len(c) == 1 for c in chunks)
    assert all(utils.is_moe_param(p) for p in experts) and not any(utils.is_moe_param(p) for p in dense)
    assert [utils.is_moe_param_group(g) for g in groups[:2]] == [False, True]
    one = utils.split_params_into_different_moe_groups_for_optimizer(({"params": experts},), max_group_size=None)
    assert [len(g["params"]) for g in one] == [0, len(experts)] and one[1]["name"] == "ep_size_2"
    assert utils.has_moe_layers(model) == (True, EXPERTS) and utils.has_moe_layers(nn.Linear(2, 2)) == (False, 0)
    with pytest.raises(Error, match="pass a param group dict"):
        utils.split_params_into_different_moe_groups_for_optimizer(iter([]))


def test_split_params_matches_deepspeeds(monkeypatch):
    """DeepSpeed 0.19.8's own split of the same parameters (it reads the same allreduce/group_name marks)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    theirs = import_deepspeed("deepspeed.moe.utils").split_params_into_different_moe_groups_for_optimizer
    ours = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer
    model = make_model("top2 dropless")
    head = list(model.head.parameters())

    def groups():
        rest = [p for p in model.parameters() if all(p is not q for q in head)]
        return [{"params": rest, "name": "body", "weight_decay": 0.1}, {"params": head, "name": "head", "lr": 1e-3}]

    def shape(split):
        return [({k: v for k, v in g.items() if k != "params"}, [id(p) for p in g["params"]]) for g in split]

    for size in (178956971, 3000):
        assert shape(ours(groups(), max_group_size=size)) == shape(theirs(groups(), max_group_size=size)), size

