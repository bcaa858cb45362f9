"""HSDP: ZeRO sharded inside groups of data-parallel ranks and replicated across them, exact against one process.

`data_parallel.replicate: 2` on 4 ranks shards over dp_shard = 2 and replicates over dp_replicate = 2: gradients
are reduce-scattered inside a shard group and each shard all-reduced across the replicas once a step. ZeRO-1, 2
and 3 on a transformers Llama, ZeRO-3 on the Mixtral with its experts split over ep2 inside each shard group, and
ZeRO-3 with tp2 on 8 ranks train 3 steps on rows with masked prompts, fp32, clipping active, and must match one
process in the loss and gradient norm of every step and every tensor at the end (1e-5). DeepSpeed's
`zero_optimization.mics_shard_size: 2` is the same layout and gives the same numbers bit for bit.
"""

from __future__ import annotations

import pytest

from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import hf_param_groups
from tests.distributed.test_real_data import ROWS, STEPS, model_factory, real_layout
from tests.real_data import RealRows, documents_loss

pytestmark = pytest.mark.multiprocess

CLIP = 0.05


def hsdp(micro: int, dp: int, replicate: int = 2, **kw) -> dict:
    cfg = real_layout(micro, dp, **kw)
    cfg["data_parallel"] = {**cfg["data_parallel"], "replicate": replicate}
    return cfg


def mics(micro: int, dp: int, shard: int, **kw) -> dict:
    cfg = real_layout(micro, dp, **kw)
    cfg["zero_optimization"] = {**cfg["zero_optimization"], "mics_shard_size": shard}
    return cfg


LAYOUTS = {"zero1 r2": hsdp(1, 4, zero=1), "zero2 r2": hsdp(1, 4, zero=2), "zero3 r2": hsdp(1, 4, zero=3),
           "zero3 mics2": mics(1, 4, 2, zero=3), "zero3 r2 ep2": hsdp(1, 4, zero=3, ep=2),
           "zero3 r2 tp2": hsdp(1, 4, zero=3, tp=2), "zero2 r2 tp2": hsdp(1, 4, zero=2, tp=2, sp=True)}
MATRIX_4 = [("llama", name) for name in ("zero1 r2", "zero2 r2", "zero3 r2", "zero3 mics2")] + \
    [("mixtral", "zero3 r2 ep2")]
MATRIX_8 = [("llama", "zero3 r2 tp2"), ("llama", "zero2 r2 tp2")]


def _replica_sums(engine) -> dict:
    """ZeRO-3: of the last step's flat shards, how many were summed over the replicas during the backward."""
    sync = engine.grad_sync
    return {"early": sync.early_replica_sums, "flats": len(sync._flats())} if hasattr(sync, "_flats") else {}


def _run(matrix: list[tuple[str, str]]) -> list:
    return [run_layout(LAYOUTS[name], model_factory(family), RealRows("masked"), STEPS, keep_state=True,
                       model_parameters=hf_param_groups, inspect=_replica_sums) for family, name in matrix]


def _check(per_rank: list[list], matrix: list[tuple[str, str]]) -> dict[str, object]:
    refs, runs = {}, {}
    for i, (family, name) in enumerate(matrix):
        run = per_rank[0][i]
        assert run.train_batch_size == ROWS and "replicate 2" in run.case, (name, run.case)
        if family not in refs:
            refs[family] = reference_run(model_factory(family), reference_config(LAYOUTS[name], run),
                                         RealRows("masked"), STEPS, loss_of=documents_loss,
                                         param_groups=hf_param_groups)
            assert all(norm > CLIP for norm in refs[family].grad_norms), family
        summary = summarize(compare(run, refs[family]))
        assert summary["passed"], (family, name, run.case, summary)
        if "zero3" in name:  # the replicas' sums start during the backward: every shard's but the root's, which
            # is reduced last (its inputs are token ids) and collected by the step
            assert run.extra["early"] == run.extra["flats"] - 1 > 0, (name, run.extra)
        # the replicas hold the same shards: every rank ends with the same losses
        assert all(other[i].losses == run.losses for other in per_rank[1:]), name
        print(f"{family} {name} ({run.case}): loss {summary['loss_err']:.1e} norm {summary['norm_err']:.1e} "
              f"param {summary['param_err']:.1e} {run.extra}")
        runs[name] = run
    return runs


def test_hsdp_zero_1_2_3_mics_and_experts_4_ranks(world4):
    runs = _check(world4.run(_run, MATRIX_4), MATRIX_4)
    native, deepspeed = runs["zero3 r2"], runs["zero3 mics2"]
    assert deepspeed.losses == native.losses and deepspeed.grad_norms == native.grad_norms
    assert all((deepspeed.final_state[k] == v).all() for k, v in native.final_state.items())


def test_hsdp_with_tensor_parallelism_8_ranks(world8):
    _check(world8.run(_run, MATRIX_8), MATRIX_8)
