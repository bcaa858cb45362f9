"""Sharded init (`meta_init: "sharded"`): each rank draws only its part of a meta model, in row blocks. The
values are not eager construction's but have its distribution per tensor, are the same in every layout, and
the model trains. (The default, bit-equal to eager construction, is tests/distributed/test_deferred_init.py.)"""

from __future__ import annotations

import math

import pytest
import torch

import paratrain
from tests.cases import adamw_config, corpus_windows, tiny_llama

pytestmark = pytest.mark.multiprocess

BLOCK = 256  # elements per row block here: the embedding (256 x 32) is 32 blocks, a 32 x 32 linear 4
LAYOUTS = {"zero3": dict(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0}),
           "zero1": dict(zero_optimization={"stage": 1}), "tp2": dict(tensor_parallel={"size": 2})}


def _sharded_states() -> dict:
    from paratrain.init import sharded as sharded_init

    sharded_init.BLOCK_NUMEL = BLOCK
    eager, *_ = paratrain.initialize(model=tiny_llama(), config=adamw_config(train_micro_batch_size_per_gpu=1))
    out = {"eager": eager.full_state_dict()}
    eager.destroy()
    for name, layout in LAYOUTS.items():
        with paratrain.init_empty():
            model = tiny_llama()
        cfg = adamw_config(train_micro_batch_size_per_gpu=1, meta_init="sharded", **layout)
        engine, _, loader, _ = paratrain.initialize(model=model, config=cfg, training_data=corpus_windows())
        out[name] = engine.full_state_dict()
        if name == "zero3":
            out["losses"] = [float(engine.train_batch(loader)) for _ in range(6)]
        engine.destroy()
    return out


def repeated_pairs(state: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """Pairs of drawn tensors whose first values are proportional (the same draws, scaled by another std)."""
    drawn = {k: v.flatten()[:64] / v.std() for k, v in state.items() if v.numel() >= 64 and v.std() > 0}
    names = sorted(drawn)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if torch.allclose(drawn[a], drawn[b], rtol=1e-4, atol=1e-6)]


def _one_rank_sharded(drop_the_name: bool) -> dict:
    from paratrain.init import sharded as sharded_init

    sharded_init.BLOCK_NUMEL = BLOCK
    if drop_the_name:  # the broken variant the check must catch: one seed per block index for every tensor
        original = sharded_init.ShardedInit._seed
        sharded_init.ShardedInit._seed = lambda self, name, block: original(self, "", block)
    try:
        with paratrain.init_empty():
            model = tiny_llama()
        engine, *_ = paratrain.initialize(model=model, config=adamw_config(train_micro_batch_size_per_gpu=1,
                                                                          meta_init="sharded"))
        return engine.full_state_dict()
    finally:
        if drop_the_name:
            sharded_init.ShardedInit._seed = original


def test_no_two_tensors_share_their_draws_and_a_seed_without_the_name_is_caught(world1):
    assert repeated_pairs(world1.run(_one_rank_sharded, False)[0]) == []
    broken = repeated_pairs(world1.run(_one_rank_sharded, True)[0])
    assert ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight") in broken
    assert len(broken) >= 20, broken  # every pair of tensors drawn alike


def _linear_defaults() -> dict:
    """nn.Linear's own init (kaiming-uniform weights, fan-in bounded biases), drawn in row blocks."""
    from paratrain.init import sharded as sharded_init

    sharded_init.BLOCK_NUMEL = BLOCK
    with paratrain.init_empty():
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 32))
    engine, *_ = paratrain.initialize(model=model, config=adamw_config(train_micro_batch_size_per_gpu=1,
                                                                      meta_init="sharded"))
    return engine.full_state_dict()


def test_sharded_init_keeps_nn_linears_fan_in_bounds(world1):
    state = world1.run(_linear_defaults)[0]
    for layer, fan_in in (("0", 64), ("2", 96)):
        bound = 1 / math.sqrt(fan_in)  # uniform(-bound, bound): std bound / sqrt(3)
        for kind in ("weight", "bias"):
            t = state[f"{layer}.{kind}"]
            assert float(t.abs().max()) <= bound, (layer, kind)
            assert float(t.abs().max()) > 0.9 * bound, (layer, kind)  # the whole range is used
            if kind == "weight":
                assert abs(float(t.std()) / (bound / math.sqrt(3)) - 1) < 0.1, layer


def test_sharded_init_has_eagers_distribution_the_same_values_in_every_layout_and_trains(world2):
    result = world2.run(_sharded_states)
    eager, ours = result[0]["eager"], result[0]["zero3"]
    assert set(ours) == set(eager)
    for name, want in eager.items():
        got = ours[name]
        if want.std() == 0:  # a constant (the norms' ones): exactly the constant
            assert torch.equal(got, want), name
            continue
        assert not torch.equal(got, want), name  # drawn anew, not eager's values
        assert abs(float(got.std() / want.std()) - 1) < 0.15, (name, float(got.std()), float(want.std()))
        assert abs(float(got.mean())) < 4 * float(want.std()) / math.sqrt(got.numel()), name
    # blocks are drawn from their own seeds: no two blocks of the embedding (8 rows each) repeat each other,
    # and no two tensors repeat (or scale) each other's values
    blocks = ours["model.embed_tokens.weight"].view(32, -1)
    assert len({tuple(b.tolist()) for b in blocks}) == 32
    assert repeated_pairs(ours) == []
    for row in result:  # the same values on every rank and in every layout, bit for bit
        for layout in LAYOUTS:
            assert all(torch.equal(row[layout][k], ours[k]) for k in ours), layout
    losses = result[0]["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
