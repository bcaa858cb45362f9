"""Muon's one-process arithmetic against torch's, the expert-stack convention, the owners' balance, and the
config's errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from paratrain.config import ConfigError, load_config
from paratrain.errors import InvalidValueError
from paratrain.layout.placement import Placement
from paratrain.muon import MasterLayout, Muon, Piece
from paratrain.muon.layout import assign_owners
from paratrain.muon.newton_schulz import lr_ratio, ns_flops
from paratrain.optim import build_optimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 48, bias=False),
                         nn.Linear(48, 16))


def _split(model: nn.Module) -> tuple[list, list]:
    muon = [model[1].weight, model[3].weight, model[4].weight]
    return muon, [p for p in model.parameters() if not any(p is q for q in muon)]


@pytest.mark.parametrize("options", [{}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw", "ns_steps": 3}])
def test_unbound_muon_is_torch_muon_plus_adamw_bit_for_bit(options):
    model, ref = _model(), None
    ref = copy.deepcopy(model)
    mine_muon, mine_rest = _split(model)
    ref_muon, ref_rest = _split(ref)
    mine = Muon([{"params": mine_muon, "use_muon": True}, {"params": mine_rest, "use_muon": False}], lr=0.02,
                adamw={"lr": 3e-3, "weight_decay": 0.02}, **options)
    theirs = [torch.optim.Muon(ref_muon, lr=0.02, **options), torch.optim.AdamW(ref_rest, lr=3e-3, weight_decay=0.02)]
    x = torch.randint(0, 50, (4, 8))
    for _ in range(3):
        for net, optimizers in ((model, [mine]), (ref, theirs)):
            net(x).pow(2).mean().backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    state = mine.state_dict()  # one buffer per Muon tensor, AdamW's two (and its step) for the rest
    assert {k for s in state["state"].values() for k in s} == {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"}
    assert sum(len(s) for s in state["state"].values()) == 3 * 1 + len(mine_rest) * 3


def test_a_stack_of_expert_matrices_is_torch_muon_on_each_matrix():
    torch.manual_seed(3)
    stack = nn.Parameter(torch.randn(4, 24, 8))
    apart = [nn.Parameter(stack.detach()[e].clone()) for e in range(4)]
    mine = Muon([{"params": [stack], "use_muon": True}], lr=0.05)  # a 3-d tensor is Muon's when a group says so
    theirs = torch.optim.Muon(apart, lr=0.05)
    for _ in range(3):
        grad = torch.randn(4, 24, 8)
        stack.grad = grad.clone()
        for e, p in enumerate(apart):
            p.grad = grad[e].clone()
        mine.step()
        theirs.step()
    assert all(torch.equal(stack[e], apart[e]) for e in range(4))
    assert lr_ratio((4, 24, 8), None) == lr_ratio((24, 8), None) == 3 ** 0.5  # the matrix's shape, not (E, rows)


def test_owners_balance_the_newton_schulz_work():
    from paratrain.layout.mesh import Axis

    axis = Axis("dp", (0, 1, 2), 1, None)
    shapes = [(64, 16), (16, 64), (32, 32), (8, 8), (48, 16), (16, 16)]
    pieces, offset = [], 0
    for shape in shapes:
        pieces.append(Piece(offset, shape, Placement()))
        offset += shape[0] * shape[1]
    stack = Piece(offset, (4, 16, 8), Placement())
    layout = MasterLayout((*pieces, stack), offset + 4 * 16 * 8 + 1, axis)
    owners = assign_owners([layout], steps=1)
    assert len(owners) == len(shapes) + 4  # every matrix once, each expert of the stack on its own
    load = [0, 0, 0]
    for (_, pi, _), owner in owners.items():
        load[owner] += ns_flops(layout.pieces[pi].matrix_shape, 1)
    biggest = max(ns_flops(s, 1) for s in shapes)
    assert max(load) - min(load) <= biggest, load  # greedy, largest first: within one matrix of even


def test_owners_balance_a_shape_mix_that_round_robin_would_not():
    """Big and small matrices alternating in the buffer, two ranks: dealt in turn, rank 0 would get every big
    one (loads 3B and 3s); largest first to the least loaded gives 2B and B + 3s, within one matrix of even."""
    from paratrain.layout.mesh import Axis

    shapes = [(32, 32), (8, 8)] * 3
    pieces, offset = [], 0
    for shape in shapes:
        pieces.append(Piece(offset, shape, Placement()))
        offset += shape[0] * shape[1]
    layout = MasterLayout(tuple(pieces), offset, Axis("dp", (0, 1), 0, None))
    owners = assign_owners([layout], steps=5)
    big, small = ns_flops((32, 32), 5), ns_flops((8, 8), 5)
    load = [0, 0]
    for (_, pi, _), owner in owners.items():
        load[owner] += ns_flops(layout.pieces[pi].matrix_shape, 5)
    assert sorted(load) == sorted([2 * big, big + 3 * small]), load
    assert max(load) - min(load) <= big
    assert [owners[(0, pi, 0)] for pi in (0, 2, 4)] == [0, 1, 0]  # the big ones spread over both ranks


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="optimizer.params.adamw.beta"):
        load_config({"optimizer": {"type": "Muon", "params": {"adamw": {"beta": [0.9, 0.95]}}}})
    with pytest.raises(ConfigError, match="optimizer.params.ns_dtype"):
        load_config({"optimizer": {"type": "Muon", "params": {"ns_dtype": "float16"}}})
    with pytest.raises(ConfigError, match="optimizer.params.adjust_lr_fn"):
        load_config({"optimizer": {"type": "Muon", "params": {"adjust_lr_fn": "rms"}}})
    cfg = load_config({"optimizer": {"type": "Muon", "params": {"lr": 0.02, "adamw": {"betas": [0.9, 0.95]},
                                                                "adamw_names": ["*.bias"]}}})
    opt = build_optimizer(cfg.optimizer, [{"params": [nn.Parameter(torch.ones(3, 3))], "use_muon": True},
                                          {"params": [nn.Parameter(torch.ones(3))], "use_muon": False}])
    assert isinstance(opt, Muon) and opt.param_groups[1]["betas"] == (0.9, 0.95) and opt.param_groups[0]["lr"] == 0.02


def test_the_spec_gives_muon_the_hidden_matrices_and_adamw_the_rest():
    from paratrain.engine.muon_setup import muon_param_groups
    from paratrain.model_spec import spec_for
    from paratrain.models.llama_moe.model import LlamaMoE
    from tests.cases import tiny_gpt

    model = tiny_gpt()
    cfg = load_config({"optimizer": {"type": "Muon", "params": {"adamw_names": ["blocks.1.*"]}}})
    muon, adamw = muon_param_groups(model, cfg, None)
    assert muon["use_muon"] and not adamw["use_muon"]
    assert set(muon["params"]) == {f"blocks.0.{m}.weight" for m in ("attn.q", "attn.k", "attn.v", "attn.o",
                                                                      "mlp.fc", "mlp.proj")}
    assert {"embed.tok.weight", "embed.pos.weight", "head.weight", "blocks.0.ln1.weight"} <= set(adamw["params"])
    moe = LlamaMoE("mixtral-tiny")
    chosen = spec_for(moe).muon_parameters(moe)
    stacks = [n for n in chosen if dict(moe.named_parameters())[n].dim() == 3]
    assert stacks and not any("embed" in n or "lm_head" in n or "norm" in n for n in chosen)
    with pytest.raises(Exception, match="ln1.weight"):
        bad = load_config({"optimizer": {"type": "Muon", "params": {"muon_names": ["*.ln1.weight"]}}})
        muon_param_groups(model, bad, None)


def test_the_planner_counts_the_matrices_the_model_spec_gives_muon():
    from paratrain.model_spec import spec_for
    from paratrain.planner.model_shape import shape_from_config
    from paratrain.planner.muon import layer_matrix_params
    from tests.cases import tiny_gpt, tiny_llama

    for model in (tiny_gpt(), tiny_llama()):
        params = dict(model.named_parameters())
        chosen = sum(params[n].numel() for n in spec_for(model).muon_parameters(model))
        planned = shape_from_config(model.config)
        assert layer_matrix_params(planned) * model.config.n_layer == chosen


def test_a_deepspeed_muon_config_reads_with_deepspeeds_meanings():
    from paratrain.optim import muon_options

    muon, adamw = muon_options({"lr": 0.02, "weight_decay": 0.1, "adam_lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                "momentum": 0.9, "ns_method": "standard"})
    assert muon == {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
    assert adamw == {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    muon, adamw = muon_options({"lr": 0.02, "eps": 1e-7, "adamw": {"lr": 1e-3}})  # torch's names: eps is Muon's
    assert muon == {"lr": 0.02, "eps": 1e-7} and adamw == {"lr": 1e-3}
    with pytest.raises(ConfigError, match="ns_method"):
        muon_options({"adam_lr": 1e-3, "ns_method": "gram"})


def test_deepspeed_style_groups_keep_their_use_muon():
    from paratrain.engine.muon_setup import muon_param_groups
    from tests.cases import tiny_gpt

    model = tiny_gpt()
    cfg = load_config({"optimizer": {"type": "Muon", "params": {}}})
    groups = [{"params": ["blocks.0.attn.q.weight"], "use_muon": True},
              {"params": [n for n, _ in model.named_parameters() if n != "blocks.0.attn.q.weight"], "use_muon": False}]
    assert muon_param_groups(model, cfg, groups) == groups
    model.head.weight.use_muon = True  # DeepSpeed's tag on a parameter wins over the spec
    muon, _ = muon_param_groups(model, cfg, None)
    assert "head.weight" in muon["params"]


def test_a_ready_torch_muon_is_refused_with_the_config_to_use():
    from paratrain.engine.setup import optimizer_factory
    from paratrain.errors import InvalidValueError

    ready = torch.optim.Muon([nn.Parameter(torch.ones(3, 3))])
    with pytest.raises(InvalidValueError, match='"type": "Muon"'):
        optimizer_factory(load_config({}), ready)
    with pytest.raises(InvalidValueError, match='"type": "Muon"'):  # paratrain's own, which would turn AdamW
        optimizer_factory(load_config({}), Muon([nn.Parameter(torch.ones(3, 3))]))


def test_groups_that_say_nothing_cannot_be_bound_to_a_strategys_shards():
    shard = nn.Parameter(torch.ones(8))  # a ZeRO shard is 1-d whatever it holds
    opt = Muon([shard])
    assert opt.param_groups[0]["use_muon"] is False
    with pytest.raises(InvalidValueError, match="use_muon in every param group"):
        opt.bind([shard], [MasterLayout((Piece(0, (2, 4), Placement()),), 8)], None, torch.device("cpu"))


def test_groups_added_later_step_and_a_copy_still_steps():
    matrix, vector = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))
    opt = Muon([{"params": [matrix], "use_muon": True}], lr=0.1, adamw={"lr": 0.5})
    opt.add_param_group({"params": [vector], "use_muon": False})
    before = vector.detach().clone()
    matrix.grad, vector.grad = torch.ones(4, 3), torch.ones(3)
    opt.step()
    assert not torch.equal(vector, before) and opt.param_groups[1]["lr"] == 0.5
    twin = copy.deepcopy(opt)
    twin.step()  # its AdamW part is rebuilt with the same options
    assert twin.param_groups[1]["lr"] == 0.5 and twin.adamw_defaults["lr"] == 0.5


def test_refusals_name_the_field_before_any_collective():
    from paratrain.engine.muon_setup import muon_param_groups
    from tests.cases import tiny_gpt

    model = tiny_gpt()
    typo = load_config({"optimizer": {"type": "Muon", "params": {"adamw_names": ["router.weight"]}}})
    with pytest.raises(ConfigError, match=r"optimizer.params.adamw_names\[0\] = 'router.weight' matches no"):
        muon_param_groups(model, typo, None)
    conv = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    four_d = load_config({"optimizer": {"type": "Muon", "params": {"muon_names": ["0.weight"]}}})
    with pytest.raises(InvalidValueError, match=r"'0.weight' has shape \(4, 2, 3, 3\)"):
        muon_param_groups(conv, four_d, None)
    with pytest.raises(ConfigError, match="ns_method = 'gram'"):
        load_config({"optimizer": {"type": "Muon", "params": {"ns_method": "gram"}}})


def _sci(x: float) -> str:
    return f"{x:.1e}".replace("e-0", "e-")  # 1.6e-5, as the docs write it


def test_the_documented_muon_numbers_are_the_committed_json():
    """docs/muon.md's parity, bf16 and owners' numbers are benchmarks/results/muon_parity.json's (written by
    `python -m benchmarks.muon_parity` from the same functions test_muon.py asserts)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = json.loads((root / "benchmarks" / "results" / "muon_parity.json").read_text())
    doc = " ".join((root / "docs" / "muon.md").read_text().split())
    cases, other = result["cases"], {c["case"]: c for c in result["other"]}
    worst = {k: _sci(max(c[k] for c in cases)) for k in ("loss_err", "norm_err", "param_err")}
    assert (f"losses within {worst['loss_err']}, gradient norms within {worst['norm_err']}, parameters within "
            f"{worst['param_err']} (the test's bound is 1e-5)") in doc and result["tolerance"] == 1e-5
    groups, real = other["dp2 zero2 deepspeed groups"], other["dp2 zero1 masked rows"]
    assert f"(parameters within {_sci(groups['param_err'])} and {_sci(real['param_err'])})" in doc
    bf16, default = other["dp2 zero1 bf16"], other["dp2 zero1 ns_dtype bfloat16"]
    assert (f"losses within {_sci(default['loss_err'])}, gradient norms within {_sci(default['norm_err'])} and "
            f"weights within {_sci(default['param_err'])} after four steps") in doc
    assert (f"the loss is within {_sci(bf16['loss_err'])} of one process in bf16, where one process in fp32 is "
            f"{_sci(bf16['fp32_loss_err'])} away") in doc
    assert (f"gradient norms within {_sci(bf16['norm_err'])}; the weights are within {_sci(bf16['param_err'])} "
            f"only, farther than one process in fp32 is from one in bf16 ({_sci(bf16['fp32_param_err'])})") in doc
    per_step = {c["case"]: {n // result["steps"] for n in c["ns_matrices_per_rank"]} for c in cases}
    (ddp,), (zero1,), (ep,) = per_step["dp2"], per_step["dp2 zero1"], per_step["dp4 (ep2 folded in dp x cp) zero1"]
    assert (f"in dp2 ZeRO-1 each rank orthogonalizes {zero1} of the tiny GPT's {ddp} matrices per step (DDP: all "
            f"{ddp} on each); on the tiny Mixtral in dp4·ep2 ZeRO-1, {ep} per rank per step") in doc
