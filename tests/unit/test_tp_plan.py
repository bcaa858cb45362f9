"""Tensor-parallel plans in one process: pattern matching, the GPT's ready plan, every validation error,
the slicing of layers, and the random-number tracker."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.config import ConfigError
from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Shard
from paratrain.models import GPT_PLAN
from paratrain.parallel.tp import (
    ColumnParallelLinear,
    PlanError,
    RNGTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    match,
    resolve_plan,
)
from tests.cases import tiny_gpt
from tests.distributed.test_tp import LLAMA_PLAN, TinyLlama


def test_patterns_match_whole_dotted_paths():
    assert match("blocks.*.attn.[qkv]", "blocks.3.attn.k")
    assert not match("blocks.*.attn.[qkv]", "blocks.3.attn.o")
    assert not match("blocks.*.attn", "blocks.3.attn.q")  # no prefix matches
    assert not match("blocks.*", "blocks.3.attn")  # '*' is one component
    assert match("**.q", "blocks.3.attn.q") and match("**.q", "q") and match("blocks.**", "blocks.1.mlp.fc")
    assert match("layers.*.norm[12]", "layers.0.norm2") and not match("layers.*.norm[12]", "layers.0.norm")


def test_gpt_ready_plan_covers_every_block():
    model = tiny_gpt(n_layer=3)
    styles = resolve_plan(model, None, tp_size=4, sequence_parallel=True)
    assert styles == resolve_plan(model, GPT_PLAN, 4, True) == resolve_plan(model, "gpt", 4, True)
    for i in range(3):
        assert [styles[f"blocks.{i}.attn.{n}"] for n in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
        assert (styles[f"blocks.{i}.mlp.fc"], styles[f"blocks.{i}.mlp.proj"]) == ("colwise", "rowwise")
        assert styles[f"blocks.{i}.ln1"] == styles[f"blocks.{i}.ln2"] == "sequence"
    assert (styles["embed.tok"], styles["head"], styles["loss_fn"]) == ("vocab", "colwise_vocab", "vocab_loss")
    assert list(styles)[0] == "embed"  # module order: the plan is applied deterministically


def test_user_model_plan_resolves():
    styles = resolve_plan(TinyLlama(), LLAMA_PLAN, tp_size=2, sequence_parallel=True)
    assert styles["layers.1.attn.k_proj"] == "colwise" and styles["lm_head"] == "colwise_vocab"


def _error(model, plan, tp=2, sp=False) -> str:
    with pytest.raises(PlanError) as info:
        resolve_plan(model, plan, tp, sp)
    return str(info.value)


def test_plan_errors_name_the_module_and_the_fix():
    gpt = tiny_gpt()
    msg = _error(gpt, {**GPT_PLAN, "blocks.*.attn.qkv": "colwise"})
    assert "'blocks.*.attn.qkv' (colwise) matches no module" in msg and "blocks.1.attn.q" in msg
    assert "did you mean 'colwise'" in _error(gpt, {"blocks.*.attn.[qkv]": "colwize"})
    assert "not a built-in plan" in _error(gpt, "mistral")
    msg = _error(tiny_gpt(d_ff=100), GPT_PLAN, tp=8)  # 100 % 8 != 0 (and 32 % 8 == 0)
    assert "'blocks.0.mlp.fc' (colwise) splits out_features 100 over tensor_parallel.size 8" in msg
    assert "'blocks.0.ln1' is a LayerNorm, but style 'colwise' applies to Linear" in _error(
        gpt, {**GPT_PLAN, "blocks.*.ln1": "colwise"})
    assert "matched by 'blocks.*.attn.[qkv]' (colwise) and by '**.q' (rowwise)" in _error(
        gpt, {**GPT_PLAN, "**.q": "rowwise"})
    no_qkv = {k: v for k, v in GPT_PLAN.items() if k not in ("blocks.*.attn.[qkv]", "blocks.*.attn")}
    assert "'blocks.0.attn.o' is rowwise but no colwise layer sits beside it" in _error(gpt, no_qkv)
    gathered = {**GPT_PLAN, "blocks.*.mlp.fc": "colwise_gather"}  # the proj's input would be whole
    assert "'blocks.0.mlp.proj' is rowwise but no colwise layer sits beside it" in _error(gpt, gathered)
    qk_only = {**{k: v for k, v in GPT_PLAN.items() if k != "blocks.*.attn.[qkv]"}, "blocks.*.attn.[qk]": "colwise"}
    assert "'blocks.0.attn.v' is a Linear shaped like its colwise sibling 'blocks.0.attn.q'" in _error(gpt, qk_only)
    resolve_plan(gpt, {**qk_only, "blocks.*.attn.v": "replicate"}, 2, False)  # said on purpose: accepted
    no_proj = {k: v for k, v in GPT_PLAN.items() if k != "blocks.*.mlp.proj"}
    assert "'blocks.0.mlp.fc' is colwise but no rowwise layer" in _error(gpt, no_proj)
    no_loss = {k: v for k, v in GPT_PLAN.items() if k != "loss_fn"}
    assert "'colwise_vocab' head (['head']) and a 'vocab_loss' module (none) go together" in _error(gpt, no_loss)
    no_split = {k: v for k, v in GPT_PLAN.items() if k != "embed"}
    assert "sequence_parallel is on but the plan says nowhere where the sequence is split" in _error(
        gpt, no_split, sp=True)
    resolve_plan(gpt, no_split, 2, False)  # fine without sequence parallelism
    assert "'embed.pos' is a 'region_input' but contains no colwise" in _error(
        gpt, {**GPT_PLAN, "embed.pos": "region_input"})
    assert "'region_input' modules are nested ('blocks.0.attn')" in _error(
        gpt, {**GPT_PLAN, "blocks.*": "region_input"})
    assert "contains tensor-parallel layers" in _error(gpt, {**GPT_PLAN, "blocks.*.mlp": "sequence"})
    msg = _error(TinyLlama(), None)
    assert "needs a plan for TinyLlama" in msg and "the families with a ready plan: ['gpt'" in msg


def test_tied_weights_cannot_be_split_for_one_module():
    model = tiny_gpt()
    model.head.weight = model.embed.tok.weight
    assert "shares a parameter with ['embed.tok.weight', 'head.weight'] (tied weights)" in _error(model, GPT_PLAN)


def test_config_rejects_a_bad_plan_before_any_process_group():
    with pytest.raises(ConfigError, match="tensor_parallel.plan.blocks.0.q' = 'cols' is not a style"):
        paratrain.resolve_config({"train_batch_size": 4, "tensor_parallel": {"size": 2, "plan": {
            "blocks.0.q": "cols"}}}, world_size=2)
    cfg = paratrain.resolve_config({"train_batch_size": 4, "tensor_parallel": {"size": 2, "plan": "gpt"}}, 4)
    assert cfg.dp_size(4) == 2 and cfg.train_micro_batch_size_per_gpu == 2


def _fake_axis(rank: int, size: int) -> Axis:
    return Axis("tp", tuple(range(size)), rank, group=None)  # enough to slice; forward would communicate


def test_layers_keep_their_slice_and_pad_uneven_vocabularies():
    torch.manual_seed(0)
    linear, emb = nn.Linear(6, 10), nn.Embedding(10, 3, padding_idx=7)
    for rank in range(4):
        axis = _fake_axis(rank, 4)
        col = ColumnParallelLinear(linear, axis, pad_output=True)  # 10 -> 12 rows, 3 per rank
        want = torch.cat([linear.weight.detach(), torch.zeros(2, 6)])[3 * rank:3 * rank + 3]
        assert torch.equal(col.weight, want) and col.vocab_start == 3 * rank
        assert col.placements == {"weight": Shard(0, 10), "bias": Shard(0, 10)}  # the unpadded size
        vocab = VocabParallelEmbedding(emb, axis)
        assert vocab.weight.shape == (3, 3) and vocab.vocab_start == 3 * rank
        assert vocab.local_padding_idx == (1 if rank == 2 else None)
    row = RowParallelLinear(nn.Linear(8, 5), _fake_axis(1, 2))
    assert row.weight.shape == (5, 4) and row.placements == {"weight": Shard(1, 8)}  # the bias: replicated, which
    # the plan step records in the parallel model's placements, not the layer
    with pytest.raises(PlanError, match="out_features 10, not divisible by the tensor-parallel size 4"):
        ColumnParallelLinear(linear, _fake_axis(0, 4))


def test_a_packed_layer_keeps_its_share_of_every_part():
    torch.manual_seed(0)
    linear = nn.Linear(6, 8)  # q (4 features), k (2), v (2) packed, as grouped-query attention packs them
    for rank in range(2):
        col = ColumnParallelLinear(linear, _fake_axis(rank, 2), parts=(4, 2, 2))
        w = linear.weight.detach()
        for i, (start, size) in enumerate([(0, 4), (4, 2), (6, 2)]):
            local = size // 2
            assert torch.equal(getattr(col, f"weight_{i}"), w[start + rank * local:start + (rank + 1) * local])
            assert col.placements[f"weight_{i}"] == Shard(0, size, packed=(start, 8))
        x = torch.randn(3, 6)
        keep = [r for start, size in [(0, 4), (4, 2), (6, 2)] for r in range(start + rank * size // 2,
                                                                              start + (rank + 1) * size // 2)]
        assert torch.allclose(F.linear(x, *col.local_weight_and_bias()), linear(x)[:, keep])
    with pytest.raises(PlanError, match=r"output parts \[4, 3, 1\]"):
        ColumnParallelLinear(linear, _fake_axis(0, 2), parts=(4, 3, 1))
    with pytest.raises(PlanError, match="only 'colwise' takes part sizes"):
        paratrain.parallel.tp.plan.check_plan_syntax({"a.b": "rowwise:4,4"})


def test_split_layers_name_themselves_when_fed_the_wrong_width():
    # The width checks run before any communication, so a fake axis is enough to reach them.
    row = RowParallelLinear(nn.Linear(8, 5), _fake_axis(0, 2), name="blocks.0.mlp.proj")
    with pytest.raises(PlanError, match=r"'blocks.0.mlp.proj' \(rowwise\) expected inputs with 4 features .* got "
                                        r"shape \(2, 3, 8\): its input must be split over tp"):
        row(torch.randn(2, 3, 8))
    col = ColumnParallelLinear(nn.Linear(8, 4), _fake_axis(0, 2), name="blocks.0.attn.q")
    with pytest.raises(PlanError, match="a colwise layer cannot follow another colwise layer directly"):
        col(torch.randn(2, 3, 4))


def test_rng_tracker_streams_differ_per_rank_and_leave_the_default_stream_alone():
    draws = []
    for tp_rank in range(2):
        tracker = RNGTracker(seed=5, tp_rank=tp_rank)
        torch.manual_seed(1)
        with tracker.fork():
            private = torch.rand(3)
        with tracker.fork():
            private_next = torch.rand(3)
        default = torch.rand(3)
        draws.append((private, private_next, default))
    torch.manual_seed(1)
    untouched = torch.rand(3)
    (a, a_next, a_default), (b, _, b_default) = draws
    assert not torch.equal(a, b) and not torch.equal(a, a_next)  # per rank, and the stream advances
    assert torch.equal(a_default, untouched) and torch.equal(b_default, untouched)
