"""Every axis at once: the composition matrix at 8 and 4 ranks against the single-process reference, each
layout with and without activation checkpointing, over AdamW steps whose clipping is active.

Every case of a matrix trains the same tiny GPT on the same global batch of 8 sequences, so one reference
run (in this process) serves them all; each world runs its whole matrix in one `World.run`.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import adamw_config, corpus_windows, tiny_gpt, tiny_llama

STEPS = 5
GLOBAL_BATCH = 8
CLIP = 1.0


def layout(dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, zero: int = 0, sp: bool = False,
           ckpt: str | None = None, schedule: str = "1f1b", micro_batch: int = 2, **zero_extra) -> dict:
    """A config for one matrix entry; gradient accumulation fills the global batch of 8."""
    cfg = adamw_config(train_micro_batch_size_per_gpu=micro_batch,
                       gradient_accumulation_steps=GLOBAL_BATCH // (micro_batch * dp),
                       gradient_clipping=CLIP,
                       tensor_parallel={"size": tp, "sequence_parallel": sp},
                       context_parallel={"size": cp},
                       pipeline={"stages": pp, "schedule": schedule, "partition": "uniform",
                                 "virtual_stages": 2 if schedule in ("interleaved", "zb-v", "dualpipev") else 1},
                       zero_optimization={"stage": zero, "stage3_param_persistence_threshold": 0, **zero_extra})
    if ckpt is not None:
        cfg["activation_checkpointing"] = {"enabled": True, "granularity": ckpt}
    return cfg


def with_and_without_checkpointing(entries: list[tuple[dict, str]]) -> list[dict]:
    return [cfg for base, ckpt in entries for cfg in (layout(**base), layout(**base, ckpt=ckpt))]


# The 8-rank matrix of the issue; the second element is the granularity its checkpointed twin uses.
MATRIX_8 = with_and_without_checkpointing([
    (dict(dp=2, pp=2, tp=2), "full"),
    (dict(dp=2, tp=2, cp=2), "selective"),
    (dict(pp=2, tp=2, cp=2, schedule="zb-h1"), "full"),
    (dict(pp=4, tp=2), "selective"),
    (dict(dp=4, tp=2, zero=1), "full"),
    (dict(dp=2, pp=2, tp=2, zero=1, sp=True, micro_batch=1), "selective"),
    (dict(dp=8, zero=3, micro_batch=1), "full"),
    (dict(dp=2, tp=2, cp=2, zero=3, sp=True), "selective"),
    (dict(dp=2, pp=2, tp=2, zero=1, schedule="zb-v"), "full"),
])

MATRIX_4 = with_and_without_checkpointing([
    (dict(pp=2, cp=2), "full"),
    (dict(pp=2, tp=2, sp=True, schedule="interleaved"), "selective"),
    (dict(dp=2, pp=2, zero=2), "full"),
    (dict(dp=2, cp=2, zero=3, wrap_module_names=["blocks.*.attn", "blocks.*.mlp"]), "full"),  # nested units
    (dict(tp=2, cp=2, sp=True), "selective"),
    (dict(dp=2, tp=2, zero=2, sp=True), "selective"),
    (dict(pp=2, cp=2, schedule="dualpipev", micro_batch=1), "selective"),
    (dict(dp=2, pp=2, zero=2, schedule="zb-v"), "full"),
])


FAMILIES = {"gpt": tiny_gpt, "llama": tiny_llama}  # the Llama with grouped-query attention: tp = n_kv_head
UNIT_NAMES = {"gpt": ["blocks.*.attn", "blocks.*.mlp"], "llama": ["model.layers.*.self_attn", "model.layers.*.mlp"]}


def for_family(configs: list[dict], family: str) -> list[dict]:
    """The matrix with the family's module names where a config names modules (nested ZeRO-3 units)."""
    out = []
    for cfg in configs:
        zero = cfg["zero_optimization"]
        if "wrap_module_names" in zero:
            cfg = {**cfg, "zero_optimization": {**zero, "wrap_module_names": UNIT_NAMES[family]}}
        out.append(cfg)
    return out


def _run_matrix(configs: list[dict], family: str = "gpt") -> list:
    runs = []
    for cfg in configs:
        start = time.perf_counter()
        run = run_layout(cfg, FAMILIES[family], corpus_windows(), STEPS, keep_state=dist.get_rank() == 0)
        run.extra["seconds"] = time.perf_counter() - start
        runs.append(run)
    return runs


def _check_matrix(per_rank: list[list], configs: list[dict], family: str = "gpt") -> list[str]:
    data = corpus_windows()
    ref = reference_run(FAMILIES[family], reference_config(configs[0], per_rank[0][0]), data, STEPS)
    assert all(norm > CLIP for norm in ref.grad_norms), ref.grad_norms  # every step is clipped
    cases = []
    for i, cfg in enumerate(configs):
        run = per_rank[0][i]
        assert run.train_batch_size == GLOBAL_BATCH
        summary = summarize(compare(run, ref))
        assert summary["passed"], (run.case, summary)
        for other in per_rank[1:]:  # every rank returns the same global losses and norms
            assert other[i].losses == run.losses and other[i].grad_norms == run.grad_norms, run.case
        if "activation_checkpointing" in cfg:
            # Recomputation replays the same arithmetic: the checkpointed run equals its twin exactly.
            twin = per_rank[0][i - 1]
            assert run.losses == twin.losses and run.grad_norms == twin.grad_norms, run.case
            assert all(v.equal(twin.final_state[k]) for k, v in run.final_state.items()), run.case
        cases.append(f"{run.case}: loss {summary['loss_err']:.1e} norm {summary['norm_err']:.1e} "
                     f"param {summary['param_err']:.1e} ({run.extra['seconds']:.1f}s)")
    return cases


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_parity_matrix_8_ranks(world8, family):
    matrix = for_family(MATRIX_8, family)
    cases = _check_matrix(world8.run(_run_matrix, matrix, family), matrix, family)
    print("\n".join(cases))
    assert [c.split(":")[0] for c in cases[::2]] == [
        "dp2 x pp2 x tp2 1f1b", "dp2 x cp2 x tp2", "pp2 x cp2 x tp2 zb-h1", "pp4 x tp2 1f1b", "dp4 x tp2 zero1",
        "dp2 x pp2 x tp2 zero1 1f1b sp", "dp8 zero3", "dp2 x cp2 x tp2 zero3 sp", "dp2 x pp2 x tp2 zero1 zb-v"]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_parity_matrix_4_ranks(world4, family):
    matrix = for_family(MATRIX_4, family)
    cases = _check_matrix(world4.run(_run_matrix, matrix, family), matrix, family)
    print("\n".join(cases))
    assert "pp2 x cp2 1f1b ckpt:full" in cases[1] and "dp2 x cp2 zero3 ckpt:full" in cases[7]


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_checkpointing_needs_blocks_or_attention_cores(granularity):
    import torch

    import paratrain
    from paratrain.config import ConfigError

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    cfg = {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {"enabled": True,
                                                                             "granularity": granularity}}
    from paratrain.engine.strategies import strategies_of
    from paratrain.parallel.checks import check_model

    with pytest.raises(ConfigError, match=f'granularity "{granularity}"'):
        check_model(model, strategies_of(paratrain.resolve_config(cfg, 1)))
