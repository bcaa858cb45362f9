"""Context parallelism: the load-balanced split, ring attention against dense attention (values, gradients,
counted K/V traffic), and the GPT trained with cp alone and composed with dp and tp against the
single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import paratrain
from paratrain.config import ConfigError
from paratrain.parallel.cp import (
    SequenceSplitError,
    check_context_parallel,
    chunk_ids,
    local_positions,
    merge_sequence,
    split_sequence,
)
from paratrain.testing import rel_diff
from paratrain.testing.parity import layout_parity
from tests.cases import STABLE_EPS, TINY, adamw_config, corpus_windows, tiny_gpt

STEPS = 5


# ---- the split, pure ----------------------------------------------------------------------------------
def test_split_gives_each_rank_two_mirrored_chunks_and_merges_back():
    x = torch.arange(2 * 16).view(2, 16)
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert split_sequence(x, 2, 0)[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert split_sequence(x, 2, 1)[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    for cp in (1, 2, 4):
        pieces = [split_sequence(x, cp, r) for r in range(cp)]
        assert torch.equal(merge_sequence(pieces), x)
        assert all(torch.equal(p[0], local_positions(16, cp, r)) for r, p in enumerate(pieces))
    with pytest.raises(SequenceSplitError, match="not divisible by 2 x context_parallel.size = 8"):
        split_sequence(torch.zeros(1, 12), 4, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_work_is_equal_on_every_rank(cp):
    seq = 8 * cp
    pairs = []
    for r in range(cp):
        q = local_positions(seq, cp, r)
        pairs.append(int((q.view(-1, 1) >= torch.arange(seq).view(1, -1)).sum()))  # unmasked (query, key) pairs
    assert len(set(pairs)) == 1 and sum(pairs) == seq * (seq + 1) // 2


def test_model_checks_name_the_problem():
    check_context_parallel(tiny_gpt(), 4)  # seq_len 16 = 2 x 4 x 2
    with pytest.raises(ConfigError, match="seq_len.*not divisible by 2 x context_parallel.size = 4"):
        check_context_parallel(tiny_gpt(seq_len=18), 2)
    with pytest.raises(ConfigError, match="attention dropout .*blocks.0.attn.core.dropout = 0.1"):
        check_context_parallel(tiny_gpt(dropout=0.1), 2)
    with pytest.raises(ConfigError, match="no replaceable causal attention core"):
        check_context_parallel(torch.nn.Linear(2, 2), 2)


# ---- ring attention against dense attention -----------------------------------------------------------
def _ring_vs_dense(cp: int, kernel: str = "auto") -> dict:
    from paratrain.comm import build_mesh
    from paratrain.layout.mesh import ParallelDims
    from paratrain.parallel.cp import ring_attention

    mesh = build_mesh(ParallelDims(dist.get_world_size(), cp=cp))
    axis = mesh.axis("cp")
    gen = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 3, 8 * cp, 8
    q, k, v, grad = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) * 2 for _ in range(4))
    dense = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*dense, is_causal=True)
    want.backward(grad)
    local = [split_sequence(t, cp, axis.rank, dim=2).requires_grad_() for t in (q, k, v)]
    mesh.stats.reset()
    out = ring_attention(*local, axis, kernel=kernel)
    forward = mesh.stats.snapshot(by_tag=True)
    mesh.stats.reset()
    out.backward(split_sequence(grad, cp, axis.rank, dim=2))
    backward = mesh.stats.snapshot(by_tag=True)
    errors = {"out": rel_diff(out.detach(), split_sequence(want, cp, axis.rank, dim=2).detach())}
    for name, mine, full in zip("qkv", local, dense):
        errors[f"d{name}"] = rel_diff(mine.grad, split_sequence(full.grad, cp, axis.rank, dim=2))
    return {"errors": errors, "forward": forward, "backward": backward, "block": b * h * (s // cp) * d}


def _check_ring(results: list[dict], cp: int) -> None:
    for r in results:
        assert max(r["errors"].values()) <= 1e-12, r["errors"]  # fp64: exact up to rounding
        block, hops = r["block"], cp - 1
        # Forward: cp - 1 hops of the K block and of the V block, sent and received, nothing else.
        kv = {"calls": 2 * hops, "elements": 2 * hops * block, "bytes": 8 * 2 * hops * block}
        assert r["forward"] == {"cp": {"send": {"cp": kv}, "recv": {"cp": kv}}}, r["forward"]
        # Backward: K and V around the ring again, and cp - 1 hops of the dK, dV accumulators.
        assert r["backward"] == {"cp": {"send": {"cp": kv, "cp_grad": kv}, "recv": {"cp": kv, "cp_grad": kv}}}


def test_ring_attention_cp2_equals_dense_with_counted_exchanges(world2):
    for kernel in ("flash_cpu", "math"):  # torch's fused CPU kernel per block, and plain matmuls
        _check_ring(world2.run(_ring_vs_dense, 2, kernel), 2)


def test_ring_attention_cp4_equals_dense_with_counted_exchanges(world4):
    _check_ring(world4.run(_ring_vs_dense, 4), 4)


# ---- the GPT against the single-process reference -----------------------------------------------------
def _parity(cp: int, tp: int = 1, sp: bool = False, accumulation: int = 1) -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=accumulation,
                       context_parallel={"size": cp}, tensor_parallel={"size": tp, "sequence_parallel": sp})
    cfg["optimizer"]["params"]["eps"] = STABLE_EPS
    data = corpus_windows()
    x, y = (torch.stack(t) for t in zip(data[0], data[1]))

    def ranks_params_and_one_forward(engine) -> dict:
        out = {"dp": engine.mesh.size("dp"), "cp_rank": engine.mesh.local_rank("cp"),
               "tp_rank": engine.mesh.local_rank("tp"),
               "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}
        engine.comm_stats(reset=True)
        engine(x, y)  # one forward, only to count its exchanges
        out["forward_cp"] = engine.comm_stats(reset=True, by_tag=True).get("cp", {})
        return out

    result = layout_parity(cfg, tiny_gpt, data, STEPS, inspect=ranks_params_and_one_forward)
    result["case"] = f"cp{cp} tp{tp} sp={sp} dp{result['dp']} gas{accumulation}"
    result["micro_batch_tokens"] = x.numel()
    return result


def _parity_cases(cases: list[tuple]) -> list[dict]:
    return [_parity(*case) for case in cases]


def _check_parity(per_rank: list[list[dict]]) -> list[str]:
    seen = []
    for case_index, first in enumerate(per_rank[0]):
        ranks = [r[case_index] for r in per_rank]
        for r in ranks:
            assert r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, \
                {k: r[k] for k in ("case", "loss_err", "norm_err", "param_err", "where")}
        assert first["losses"][-1] < first["losses"][0], first["case"]  # it trains
        cp = int(first["case"].split()[0][2:])
        tp = int(first["case"].split()[1][2:])
        # Parameters are replicated over cp: bit-identical on every cp rank (same tp rank, same dp rank).
        for r in ranks:
            if r["cp_rank"] > 0:
                twin = next(o for o in ranks if o["cp_rank"] == 0 and o["tp_rank"] == r["tp_rank"])
                for name, value in r["params"].items():
                    assert torch.equal(value, twin["params"][name]), (first["case"], name)
        # One micro-batch forward: per layer cp - 1 hops of K and of V, each b (s/cp) (h/tp) elements.
        block = first["micro_batch_tokens"] // cp * TINY["d_model"] // tp
        hops = 2 * TINY["n_layer"] * (cp - 1)
        kv = {"cp": {"calls": hops, "elements": hops * block, "bytes": 4 * hops * block}}
        assert first["forward_cp"] == {"send": kv, "recv": kv}, (first["case"], first["forward_cp"])
        seen.append(first["case"])
    return seen


def test_cp2_parity(world2):
    assert _check_parity(world2.run(_parity_cases, [(2,), (2, 1, False, 2)])) == ["cp2 tp1 sp=False dp1 gas1",
                                                                                  "cp2 tp1 sp=False dp1 gas2"]


def test_cp4_dp2_cp2_tp2_cp2_parity(world4):
    cases = [(4,), (2,), (2, 2, False), (2, 2, True)]
    assert _check_parity(world4.run(_parity_cases, cases)) == [
        "cp4 tp1 sp=False dp1 gas1", "cp2 tp1 sp=False dp2 gas1", "cp2 tp2 sp=False dp1 gas1",
        "cp2 tp2 sp=True dp1 gas1"]


# ---- bad layouts fail on every rank, before any collective ----------------------------------------------
def _bad_layout(overrides: dict) -> str | None:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, context_parallel={"size": 2})
    try:
        paratrain.initialize(model=tiny_gpt(**overrides), config=cfg)
    except ConfigError as exc:
        return str(exc)
    return None


def test_bad_layouts_fail_identically_on_every_rank(world2):
    messages = world2.run(_bad_layout, {"seq_len": 18})
    assert messages[0] == messages[1] and "context_parallel.size" in messages[0] and "seq_len" in messages[0]
    messages = world2.run(_bad_layout, {"dropout": 0.1})
    assert messages[0] == messages[1] and "attention dropout" in messages[0]
    world2.run(dist.barrier)  # nobody is stuck in a collective
