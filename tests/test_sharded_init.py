"""Sharded init (`meta_init: "sharded"`): each rank draws only its part of a meta model, in row blocks. The
values are not eager construction's but have its distribution per tensor, are the same in every layout, and
the model trains. (The default, bit-equal to eager construction, is tests/test_deferred_init.py.)"""

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
    from paratrain import sharded_init

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
    # blocks are drawn from their own seeds: no two blocks of the embedding (8 rows each) repeat each other
    blocks = ours["model.embed_tokens.weight"].view(32, -1)
    assert len({tuple(b.tolist()) for b in blocks}) == 32
    for row in result:  # the same values on every rank and in every layout, bit for bit
        for layout in LAYOUTS:
            assert all(torch.equal(row[layout][k], ours[k]) for k in ours), layout
    losses = result[0]["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
