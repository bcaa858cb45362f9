"""Mixture of experts, one process: the router and its losses against hand computations, the batched experts
against a per-token loop (forward and gradients, dropless and dropping), the Llama MoE variants and their
parameter counts, and DeepSpeed's `deepspeed.moe.layer.MoE` against a loop of DeepSpeed's gating rules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain as deepspeed
from paratrain.config import ConfigError
from paratrain.errors import Error
from paratrain.model_spec import spec_for
from paratrain.models import LlamaMoE, LlamaMoEConfig, build_model, llama_moe_config
from paratrain.moe import (
    MoELayer,
    Router,
    StackedMLP,
    combine,
    dispatch,
    expert_capacity,
    load_balancing_loss,
    plan_dispatch,
    router_z_loss,
)
from paratrain.parallel.recompute import checkpoint_activations


# ---- router and losses ---------------------------------------------------------------------------------------
def _router(score_func: str, norm: bool) -> Router:
    router = Router(2, 3, top_k=2, score_func=score_func, norm_topk_prob=norm)
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    return router


def test_router_softmax_topk_by_hand():
    x = torch.tensor([[1.0, 2.0]])  # logits (1, 2, 3)
    e = [math.exp(v) for v in (1.0, 2.0, 3.0)]
    probs = [v / sum(e) for v in e]
    raw = _router("softmax", norm=False)(x)
    assert raw.experts.tolist() == [[2, 1]]
    assert torch.allclose(raw.weights, torch.tensor([[probs[2], probs[1]]]))
    assert torch.allclose(raw.logits, torch.tensor([[1.0, 2.0, 3.0]]))
    normed = _router("softmax", norm=True)(x)
    top = probs[2] + probs[1]
    assert torch.allclose(normed.weights, torch.tensor([[probs[2] / top, probs[1] / top]]))


def test_router_sigmoid_by_hand():
    x = torch.tensor([[1.0, -2.0]])  # logits (1, -2, -1)
    s = [1 / (1 + math.exp(-v)) for v in (1.0, -2.0, -1.0)]
    routing = _router("sigmoid", norm=True)(x)
    assert routing.experts.tolist() == [[0, 2]]
    assert torch.allclose(routing.weights, torch.tensor([[s[0] / (s[0] + s[2]), s[2] / (s[0] + s[2])]]))
    assert torch.allclose(routing.probs, torch.tensor([[v / sum(s) for v in s]]))  # normalised for P_e


def test_load_balancing_loss_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.7, 0.2, 0.1]])
    experts = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1]])  # T = 4, k = 2: counts 3, 3, 2 of 8 choices
    f = [3 / 8, 3 / 8, 2 / 8]
    p = [(0.5 + 0.1 + 0.2 + 0.7) / 4, (0.3 + 0.6 + 0.2 + 0.2) / 4, (0.2 + 0.3 + 0.6 + 0.1) / 4]
    expected = 3 * sum(fe * pe for fe, pe in zip(f, p))
    assert load_balancing_loss(probs, experts, 3).item() == pytest.approx(expected, rel=1e-6)
    uniform = torch.full((6, 3), 1 / 3)
    balanced = torch.tensor([[0], [1], [2], [0], [1], [2]])
    assert load_balancing_loss(uniform, balanced, 3).item() == pytest.approx(1.0)


def test_router_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    lse = [math.log(2.0), math.log(math.exp(1.0) + math.exp(2.0))]
    assert router_z_loss(logits).item() == pytest.approx((lse[0] ** 2 + lse[1] ** 2) / 2, rel=1e-6)


def test_capacity_formula():
    assert expert_capacity(10, 2, 4, 1.0) == 5  # ceil(2 * 10 / 4 * 1.0)
    assert expert_capacity(10, 1, 4, 1.25) == 4  # ceil(3.125)
    assert expert_capacity(3, 1, 4, 1.0, min_capacity=4) == 4
    assert expert_capacity(10, 2, 4, None) is None
    with pytest.raises(Error, match="capacity_factor = 0"):
        expert_capacity(10, 2, 4, 0)


# ---- the layer against a per-token loop ------------------------------------------------------------------------
def _swiglu(layer: MoELayer, e: int, x: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    return ex.down_proj[e] @ (F.silu(ex.gate_proj[e] @ x) * (ex.up_proj[e] @ x))


def _reference(layer: MoELayer, x: torch.Tensor):
    """Token by token: route, keep a choice while its expert has room (token order), sum weighted experts."""
    flat = x.reshape(-1, x.shape[-1])
    routing = layer.gate(flat)
    capacity = expert_capacity(flat.shape[0], layer.top_k, layer.num_experts, layer.capacity_factor)
    used = [0] * layer.num_experts
    rows, dropped = [], 0
    for t in range(flat.shape[0]):
        y = flat.new_zeros(flat.shape[-1])
        for j in range(layer.top_k):
            e = int(routing.experts[t, j])
            if capacity is not None and used[e] >= capacity:
                dropped += 1
                continue
            used[e] += 1
            y = y + routing.weights[t, j] * _swiglu(layer, e, flat[t])
        if layer.shared_experts is not None:
            y = y + layer.shared_experts(flat[t])
        rows.append(y)
    return torch.stack(rows).reshape(x.shape), dropped


def _grads(layer: MoELayer, x: torch.Tensor, out: torch.Tensor):
    weight = torch.linspace(-1, 1, out.numel()).view_as(out)  # a loss that weights every output differently
    params = [x, *layer.parameters()]
    return torch.autograd.grad((out * weight).sum(), params)


@pytest.mark.parametrize("capacity_factor, shared", [(None, 0), (0.5, 0), (1.0, 1), (None, 2)])
def test_grouped_experts_equal_a_per_token_loop(capacity_factor, shared):
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 12, top_k=2, capacity_factor=capacity_factor, shared_experts=shared, shared_d_ff=6)
    x = torch.randn(2, 7, 8, requires_grad=True)
    out = layer(x)
    ref, dropped = _reference(layer, x)
    torch.testing.assert_close(out.output, ref, rtol=1e-5, atol=1e-6)
    assert layer.last.dropped == dropped
    assert (dropped > 0) == (capacity_factor is not None)  # the capacity cases do drop: they test dropping
    for got, want in zip(_grads(layer, x, out.output), _grads(layer, x, ref)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_an_expert_without_tokens(capacity_factor):
    torch.manual_seed(1)
    layer = MoELayer(8, 4, 12, top_k=1, capacity_factor=capacity_factor, router_bias=True)
    with torch.no_grad():
        layer.gate.gate.bias.copy_(torch.tensor([0.0, 0.0, 0.0, -1e4]))  # expert 3 never wins
    x = torch.randn(9, 8, requires_grad=True)
    out = layer(x)
    assert layer.last.counts[3] == 0
    ref, _ = _reference(layer, x)
    torch.testing.assert_close(out.output, ref, rtol=1e-5, atol=1e-6)
    got, want = _grads(layer, x, out.output), _grads(layer, x, ref)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert got[-3][3].abs().sum() == 0 and got[-3][:3].abs().sum() > 0  # no token, no gradient for expert 3


def test_dropped_token_accounting():
    # 6 tokens all routed to expert 0 (top-1), capacity ceil(6/3 * 1.0) = 2: tokens 2..5 dropped in token order
    experts = torch.zeros(6, 1, dtype=torch.long)
    weights = torch.ones(6, 1)
    plan = plan_dispatch(experts, weights, 3, expert_capacity(6, 1, 3, 1.0))
    assert plan.counts.tolist() == [6, 0, 0] and plan.capacity == 2
    assert (plan.dropped, plan.dropped_tokens) == (4, 4)
    assert plan.token.tolist() == [0, 1]
    x = torch.arange(12.0).view(6, 2)
    y = combine(dispatch(x, plan), plan)  # identity experts: kept tokens come back, dropped ones are 0
    torch.testing.assert_close(y, torch.cat([x[:2], torch.zeros(4, 2)]))
    # top-2: a token that keeps one of its two choices is not a dropped token
    plan2 = plan_dispatch(torch.tensor([[0, 1], [0, 1], [0, 2]]), torch.ones(3, 2), 3, 2)
    assert (plan2.dropped, plan2.dropped_tokens) == (1, 0)


def test_dispatch_buffer_is_per_expert_in_token_order():
    experts = torch.tensor([[2], [0], [2], [1], [2]])
    plan = plan_dispatch(experts, torch.ones(5, 1), 3, None)  # dropless: C = the largest count, 3
    x = torch.arange(5.0).view(5, 1)
    buffer = dispatch(x, plan)
    assert buffer.shape == (3, 3, 1)
    assert buffer[:, :, 0].tolist() == [[1.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 2.0, 4.0]]


# ---- the Llama MoE variants ----------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["mixtral-tiny", "deepseek-tiny"])
def test_moe_llamas_train(preset):
    torch.manual_seed(0)
    model = build_model(preset, capacity_factor=1.25 if preset == "mixtral-tiny" else None, z_loss_coef=1e-3)
    assert model.num_params() == model.config.num_params()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 256, (4, 16))
    losses = []
    for _ in range(8):
        loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.1, losses
    assert model.model.layers[-1].mlp.experts.gate_proj.grad.abs().sum() > 0


def test_the_loss_adds_the_weighted_router_losses():
    torch.manual_seed(0)
    model = LlamaMoE("deepseek-tiny", aux_loss_coef=0.5, z_loss_coef=0.25)
    idx = torch.randint(0, 256, (2, 16))
    loss = model(idx, idx)
    moe = [layer.mlp for layer in model.model.layers[1:]]  # block 0 is dense
    assert not isinstance(model.model.layers[0].mlp, MoELayer) and all(isinstance(m, MoELayer) for m in moe)
    ce = model.loss_fn(model(idx), idx)
    aux = sum(m.last.aux_loss for m in moe) / len(moe)
    z = sum(m.last.z_loss for m in moe) / len(moe)
    assert loss.item() == pytest.approx(ce.item() + 0.5 * aux + 0.25 * z, rel=1e-5)
    assert float(model.last_losses["aux_loss"]) == pytest.approx(aux, rel=1e-6)


def test_full_activation_checkpointing_of_moe_blocks_keeps_loss_and_gradients():
    torch.manual_seed(0)
    plain = LlamaMoE("mixtral-tiny", z_loss_coef=1e-2)
    ckpt = LlamaMoE("mixtral-tiny", z_loss_coef=1e-2)
    ckpt.load_state_dict(plain.state_dict())
    applied = checkpoint_activations(ckpt, "full", blocks=spec_for(ckpt).blocks(ckpt))
    assert applied.modules == ["model.layers.0", "model.layers.1"]
    idx = torch.randint(0, 256, (2, 16))
    a, b = plain(idx, idx), ckpt(idx, idx)
    a.backward()
    b.backward()
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_published_parameter_counts():
    mixtral = llama_moe_config("mixtral-8x7b")
    assert mixtral.num_params() / 1e9 == pytest.approx(46.7, abs=0.05)  # Mistral: 46.7B total
    assert mixtral.active_params() / 1e9 == pytest.approx(12.9, abs=0.05)  # 12.9B active
    v3 = llama_moe_config("deepseek-v3-shape")  # Llama attention instead of MLA: near, not equal, to 671B / 37B
    assert v3.num_params() / 1e9 == pytest.approx(671, rel=0.01)
    assert v3.active_params() / 1e9 == pytest.approx(37, rel=0.05)


@pytest.mark.parametrize("preset", ["mixtral-tiny", "deepseek-tiny"])
def test_tiny_counts_are_exact(preset):
    cfg = llama_moe_config(preset)
    model = LlamaMoE(cfg)
    assert model.num_params() == cfg.num_params()
    d = cfg.d_model
    expert = 3 * d * cfg.d_expert
    moe_blocks = cfg.n_layer - cfg.n_dense_layers
    assert cfg.num_params() - cfg.active_params() == moe_blocks * (cfg.num_experts - cfg.top_k) * expert


def test_moe_config_refusals():
    with pytest.raises(Error, match="top_k"):
        LlamaMoEConfig(num_experts=2, top_k=3)
    with pytest.raises(Error, match="n_dense_layers"):
        LlamaMoEConfig(n_layer=2, n_dense_layers=3)
    with pytest.raises(Error, match="score_func"):
        LlamaMoEConfig(score_func="relu")


def test_the_spec_refuses_layouts_that_would_split_a_routing_group():
    model = LlamaMoE("mixtral-tiny", router_group_size=4)  # seq_len 16
    spec = spec_for(model)
    assert spec.name == "llama-moe"
    for fine in ({"cp": 2}, {"tp": 2, "sp": 1}, {"pp": 2, "ep": 2}):  # chunks of 4 and 8 tokens hold whole groups
        spec.check(model, {"dp": 1, "tp": 1, "pp": 1, "cp": 1, **fine})
    with pytest.raises(ConfigError, match=r"router_group_size 4 .* one of \[1, 2\]"):
        spec.check(model, {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "sp": 1})
    with pytest.raises(ConfigError, match="router_group_size 16"):  # the default: a whole sequence
        spec.check(LlamaMoE("mixtral-tiny"), {"cp": 2})
    with pytest.raises(ConfigError, match="n_kv_head"):
        spec.check(model, {"tp": 4})
    assert spec.pipeline_module(model, 1) is not None


# ---- deepspeed.moe.layer.MoE ---------------------------------------------------------------------------------
def _ds_moe(k: int, **options):
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6))
    moe = deepspeed.moe.layer.MoE(6, expert, num_experts=4, k=k, **options)
    with torch.no_grad():  # the copies start equal (as DeepSpeed's deep copies do); make them differ
        for p in moe.deepspeed_moe.experts.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return moe


def _ds_expert(moe, e: int, x: torch.Tensor) -> torch.Tensor:
    w, b = moe.deepspeed_moe.experts.weights, moe.deepspeed_moe.experts.biases
    return w[1][e] @ F.gelu(w[0][e] @ x + b[0][e]) + b[1][e]


def _ds_reference(moe, x: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop: bool):
    """DeepSpeed's rules, choice by choice: token order (no random token selection), firsts before seconds."""
    gate = moe.deepspeed_moe.gate
    gates = F.linear(x.float(), gate.wg.weight.float()).softmax(-1)
    s, e_count = gates.shape
    cap = max(math.ceil(s / e_count * capacity_factor * k), min_capacity) if drop else s * k
    first = gates.argmax(-1).tolist()
    second = gates.masked_fill(F.one_hot(gates.argmax(-1), e_count).bool(), -1.0).argmax(-1).tolist()
    used, kept = [0] * e_count, {}
    for rank, choice in enumerate([first, second][:k]):
        for t in range(s):
            if used[choice[t]] < cap:
                used[choice[t]] += 1
                kept[(t, rank)] = choice[t]
    out = []
    for t in range(s):
        mine = [(kept[(t, r)], gates[t, kept[(t, r)]]) for r in range(k) if (t, r) in kept]
        denom = sum(g for _, g in mine) if k == 2 else 1.0
        out.append(sum((g / denom * _ds_expert(moe, e, x[t]) for e, g in mine), x.new_zeros(x.shape[-1])))
    ce = torch.bincount(torch.tensor(first), minlength=e_count).float() / s
    l_aux = e_count * (gates.mean(0) * ce).sum()
    counts = torch.bincount(torch.tensor(first + (second if k == 2 else [])), minlength=e_count)
    return torch.stack(out), l_aux, counts


@pytest.mark.parametrize("k, capacity_factor, drop", [(1, 1.0, True), (1, 1.0, False), (2, 0.5, True),
                                                      (2, 1.0, False)])
def test_deepspeed_moe_matches_its_gating_rules(k, capacity_factor, drop):
    moe = _ds_moe(k, capacity_factor=capacity_factor, min_capacity=1, drop_tokens=drop, use_rts=False,
                  top2_2nd_expert_sampling=False)
    x = torch.randn(3, 5, 6)
    out, l_aux, counts = moe(x)
    assert out.shape == x.shape and l_aux.dim() == 0 and counts.shape == (4,)
    ref, ref_aux, ref_counts = _ds_reference(moe, x.reshape(-1, 6), k, capacity_factor, 1, drop)
    torch.testing.assert_close(out.reshape(-1, 6), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l_aux, ref_aux)
    assert counts.tolist() == ref_counts.tolist()
    l_aux.backward()
    assert moe.deepspeed_moe.gate.wg.weight.grad.abs().sum() > 0


def test_deepspeed_moe_random_token_selection_keeps_capacity():
    moe = _ds_moe(1, capacity_factor=0.5, min_capacity=1, use_rts=True)
    x = torch.randn(16, 6)
    moe(x)
    plan = moe.deepspeed_moe.gate.route(x)[0]
    kept = torch.bincount(plan.slot // plan.capacity, minlength=4)
    assert plan.capacity == 2 and kept.tolist() == torch.clamp(plan.counts, max=2).tolist()


def test_deepspeed_moe_residual_and_eval_capacity():
    moe = _ds_moe(1, use_residual=True, eval_capacity_factor=4.0, min_capacity=1, use_rts=False)
    x = torch.randn(8, 6)
    out, _, _ = moe(x)
    coef = moe.coefficient(x).softmax(-1)
    routed = moe.deepspeed_moe(x)
    torch.testing.assert_close(out, routed * coef[:, :1] + moe.mlp(x) * coef[:, 1:])
    moe.eval()
    moe(x)
    assert moe.deepspeed_moe.gate.route(x)[0].capacity == 8  # ceil(8 / 4 * 4.0)


def test_deepspeed_moe_refusals():
    assert isinstance(deepspeed.moe.layer.MoE, type)  # no longer refused by name
    linear = nn.Linear(4, 4)
    with pytest.raises(Error, match=r"ep_size=3\): ep_size must divide num_experts"):  # ep_size 2 works
        deepspeed.moe.layer.MoE(4, linear, num_experts=4, ep_size=3)
    with pytest.raises(Error, match="k=3"):
        deepspeed.moe.layer.MoE(4, linear, num_experts=4, k=3)
    with pytest.raises(Error, match="layer 1 is Conv1d"):
        StackedMLP(nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 1)), 2)
    with pytest.raises(Error, match="used_token"):
        deepspeed.moe.layer.MoE(4, linear, num_experts=2)(torch.randn(3, 4), used_token=torch.ones(3))


def test_verify_refuses_moe_rather_than_reporting_a_false_difference():
    from paratrain.config import load_config
    from paratrain.testing.verify import small_instance

    config = load_config({"train_micro_batch_size_per_gpu": 1, "trainer": {"model": "deepseek-tiny"}})
    with pytest.raises(ConfigError, match="'trainer.model' = 'deepseek-tiny' is a mixture-of-experts model"):
        small_instance(config)
