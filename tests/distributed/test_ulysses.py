"""Ulysses and USP: the all-to-all attention equals dense causal attention (values and gradients), the
layouts train like one process, their traffic is the formula's, and head counts they cannot split are
refused with the sizes that would work."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import paratrain
from paratrain.config import ConfigError, load_config
from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import adamw_config, corpus_windows, tiny_gpt, tiny_llama

STEPS = 4


def _config(cp: int, method: str, ulysses: int | None = None, dp: int = 1, tp: int = 1, pp: int = 1,
            zero: int = 0, ckpt: str | None = None) -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4 // dp,
                       context_parallel={"size": cp, "method": method, "ulysses_size": ulysses},
                       tensor_parallel={"size": tp}, pipeline={"stages": pp, "partition": "uniform"},
                       zero_optimization={"stage": zero, "stage3_param_persistence_threshold": 0})
    if ckpt:
        cfg["activation_checkpointing"] = {"enabled": True, "granularity": ckpt}
    return cfg


def _core_against_dense(method: str, ulysses: int | None, kv_heads: int) -> dict:
    """Every rank's piece of the output and of the input gradients equals dense causal attention's (fp64)."""
    from paratrain.comm import build_mesh
    from paratrain.parallel.cp import RingAttentionCore, SequenceSplit, UlyssesAttentionCore

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "context_parallel": {
        "size": dist.get_world_size(), "method": method, "ulysses_size": ulysses}})
    mesh = build_mesh(cfg.parallel_dims(dist.get_world_size()))
    cp = mesh.axis("cp")
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 16, 8
    q = torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, s, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    groups = h // kv_heads
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          is_causal=True)
    want.sum().backward()
    split = SequenceSplit.for_method(method, cp.size, cp.rank, ulysses)
    mine = [split.split(t.detach(), dim=2).requires_grad_() for t in (q, k, v)]
    if method == "usp":
        core = UlyssesAttentionCore(mesh.axis("cp_ulysses"), RingAttentionCore(mesh.axis("cp_ring")))
    else:
        core = UlyssesAttentionCore(cp)
    got = core(*mine)
    got.sum().backward()
    stats = mesh.stats.snapshot(by_tag=True)
    errors = [float((got - split.split(want.detach(), dim=2)).abs().max())]
    errors += [float((m.grad - split.split(t.grad, dim=2)).abs().max()) for m, t in zip(mine, (q, k, v))]
    mesh.destroy()
    return {"errors": errors, "stats": stats}


@pytest.mark.parametrize("method,ulysses,kv", [("ulysses", None, 4), ("ulysses", None, 2), ("usp", 2, 4),
                                               ("ulysses", None, 1)])
def test_ulysses_core_equals_dense_causal_attention(world4, method, ulysses, kv):
    for r in world4.run(_core_against_dense, method, ulysses, kv):
        assert max(r["errors"]) < 1e-12, r["errors"]


def test_ulysses_traffic_is_four_all_to_alls_of_the_local_tensor_each_way(world2):
    r = world2.run(_core_against_dense, "ulysses", None, 4)[0]
    # q, k, v and the output: (b, h, s/cp, d) = 2 x 4 x 8 x 8 each, (cp - 1)/cp of it leaves the rank;
    # forward and backward (the transposes) alike.
    local = 2 * 4 * 8 * 8
    assert r["stats"]["cp"]["all_to_all"]["ulysses"] == {"calls": 8, "elements": 8 * local // 2,
                                                         "bytes": 8 * local // 2 * 8}


def _layouts() -> dict[str, tuple[dict, str]]:
    return {
        "ulysses2": (_config(2, "ulysses"), "gpt"),
        "ulysses4": (_config(4, "ulysses"), "gpt"),
        "usp 2x2": (_config(4, "usp", 2), "gpt"),
        "dp2 ulysses2 zero3": (_config(2, "ulysses", dp=2, zero=3), "gpt"),
        "dp2 ulysses2 zero1 ckpt": (_config(2, "ulysses", dp=2, zero=1, ckpt="full"), "gpt"),
        "dp2 ulysses2 zero2": (_config(2, "ulysses", dp=2, zero=2), "gpt"),
        "tp2 ulysses2": (_config(2, "ulysses", tp=2), "gpt"),
        "ulysses2 pp2": (_config(2, "ulysses", pp=2), "gpt"),
        "llama gqa kv=2 ulysses2": (_config(2, "ulysses"), "llama"),
        "llama gqa usp 2x2 ckpt": (_config(4, "usp", 2, ckpt="selective"), "llama"),
    }


MODELS = {"gpt": tiny_gpt, "llama": tiny_llama}


def _run_all(names: list[str]) -> list:
    layouts = _layouts()
    return [run_layout(layouts[n][0], MODELS[layouts[n][1]], corpus_windows(), STEPS,
                       keep_state=dist.get_rank() == 0) for n in names]


def test_ulysses_and_usp_layouts_train_like_one_process(world4):
    layouts = _layouts()
    names = list(layouts)
    runs = world4.run(_run_all, names)[0]
    refs = {}
    for name, run in zip(names, runs):
        cfg, family = layouts[name]
        key = (family, run.train_batch_size)  # dp differs between the layouts of a world of 4
        if key not in refs:
            refs[key] = reference_run(MODELS[family], reference_config(cfg, run), corpus_windows(), STEPS)
        summary = summarize(compare(run, refs[key]))
        assert summary["passed"], (name, summary)


def test_heads_ulysses_cannot_split_are_refused_with_the_sizes_that_work():
    from paratrain.engine.strategies import strategies_of
    from paratrain.parallel.checks import check_model

    cfg = paratrain.resolve_config({"train_micro_batch_size_per_gpu": 1, "context_parallel": {
        "size": 4, "method": "ulysses"}, "tensor_parallel": {"size": 2}}, 8)
    with pytest.raises(ConfigError, match=r"splits the 2 attention heads .* into 4 groups.* in \[1, 2\]"):
        check_model(tiny_gpt(), strategies_of(cfg))


@pytest.mark.parametrize("cp,want", [
    ({"size": 4, "method": "usp"}, "needs context_parallel.ulysses_size, a divisor of context_parallel.size \\(4\\)"),
    ({"size": 2, "method": "usp", "ulysses_size": 2}, "one of none"),
    ({"size": 4, "method": "ulysses", "ulysses_size": 2}, "use method 'usp'"),
    ({"size": 4, "ulysses_size": 2}, "is for methods 'ulysses' and 'usp'"),
])
def test_bad_context_parallel_sizes_name_the_field(cp, want):
    with pytest.raises(ConfigError, match=want):
        load_config({"train_micro_batch_size_per_gpu": 1, "context_parallel": cp})
